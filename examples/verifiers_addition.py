"""A verifiers environment, written for verifiers and unaware of loopline, trained by loopline:

    loopline train env.name=verifiers:examples/verifiers_addition.py

`load_environment` is the verifiers convention (loopline calls it once per process). Its dataset is the rows
(data.source=builtin), its rubric the reward: 1 for the right sum, plus 0.2 for an answer on one line. A response
counts as correct when its reward reaches the env's pass_threshold (0.5 by default): the right sum.
"""

import random

import verifiers as vf
from datasets import Dataset


def right_sum(completion, answer, **kwargs) -> float:
    """1 when the first line of the answer is the sum."""
    text = completion[-1].content or ""
    return 1.0 if text.strip().split("\n")[0].strip() == answer else 0.0


def one_line(completion, **kwargs) -> float:
    """1 when the answer is one line."""
    return 0.0 if "\n" in (completion[-1].content or "").strip() else 1.0


def _rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n)]
    return [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def load_environment(num_train: int = 2000, num_eval: int = 64) -> vf.Environment:
    rng = random.Random(0)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(_rows(rng, num_train)),
        eval_dataset=Dataset.from_list(_rows(rng, num_eval)),
        rubric=vf.Rubric(funcs=[right_sum, one_line], weights=[1.0, 0.2]),
    )
