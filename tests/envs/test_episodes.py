"""Envs chosen by `env.name`, as the env workers run them: built-ins, a user's file or module, and envs that
misbehave (each error names the env and the prompt)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from loopline.config import ConfigError, load_config
from loopline.data.rows import PromptRow
from loopline.envs.config import EnvConfig
from loopline.envs.episodes import (
    EnvError,
    Histories,
    Verdict,
    chunk_time_limit,
    env_factory,
    score_chunk,
    step_chunk,
)
from loopline.envs.sandbox import SandboxConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_env.py"
ROWS = [PromptRow(0, "01+02=", "003"), PromptRow(1, "2+2=", "4"), PromptRow(2, "1/2=", "\\frac{1}{2}")]


def rewards(verdicts: list[Verdict]) -> list[float]:
    return [v.reward for v in verdicts]


def test_builtin_envs_score_the_first_line_or_the_math() -> None:
    texts = ["003\nmore", "5", "so \\boxed{0.5}"]
    assert rewards(score_chunk("addition", (texts, ROWS))) == [1.0, 0.0, 0.0]
    assert rewards(score_chunk("exact_match", (texts, ROWS))) == [1.0, 0.0, 0.0]
    assert rewards(score_chunk("math", (texts, ROWS))) == [1.0, 0.0, 1.0]  # "003" is 3: equal as numbers


def test_the_example_env_from_its_file_gives_partial_credit() -> None:
    name = f"python:{EXAMPLE}:make_env"
    rows = [PromptRow(0, "1+2=", "3"), PromptRow(1, "1+2=", "3"), PromptRow(2, "1+2=", "3")]
    verdicts = score_chunk(name, (["3", "13", "abc"], rows))
    assert rewards(verdicts) == [1.0, 0.4, 0.0]
    assert [v.correct for v in verdicts] == [
        True,
        False,
        False,
    ]  # correct: full marks only, not partial credit


def test_an_env_says_what_correct_means_with_its_max_reward_or_its_own_flag(tmp_path: Path) -> None:
    body = """
    from loopline.envs.base import StepResult


    class E:
        max_reward = 2.0  # full marks are 2 here

        def reset(self, row):
            self.answer = row.answer

        def step(self, text):
            reward = float(text.count("a"))
            info = {"correct": text == "flagged"} if text.startswith("flag") else {}
            return StepResult("", reward, True, info)


    def make():
        return E()
    """
    rows = [PromptRow(i, "q", "x") for i in range(5)]
    verdicts = score_chunk(_user_env(tmp_path, body), (["aa", "aaa", "a", "flagged", "flagaaa"], rows))
    assert [v.correct for v in verdicts] == [
        True,
        True,
        False,
        True,
        False,
    ]  # reward >= 2, else the env's flag


def _user_env(tmp_path: Path, body: str) -> str:
    path = tmp_path / f"env_{abs(hash(body))}.py"
    path.write_text(textwrap.dedent(body))
    return f"python:{path}:make"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            "def make():\n    raise RuntimeError('no sandbox today')\n",
            "raised RuntimeError: no sandbox today",
        ),
        (
            "from loopline.envs.base import StepResult\n"
            "class E:\n    def reset(self, row): pass\n"
            "    def step(self, text): return StepResult('', float('nan'), True)\n"
            "def make(): return E()\n",
            "reward nan is not a finite number",
        ),
        (
            "from loopline.envs.base import StepResult\n"
            "class E:\n    def reset(self, row): pass\n"
            "    def step(self, text): return StepResult('', 'high', True)\n"
            "def make(): return E()\n",
            "reward 'high' is not a finite number",
        ),
        (
            "from loopline.envs.base import StepResult\n"
            "class E:\n    def reset(self, row): pass\n"
            "    def step(self, text): return StepResult('', 1.0, True, {'correct': 'yes'})\n"
            "def make(): return E()\n",
            "info\\['correct'\\] 'yes' is not a number or bool",
        ),
        (
            "class E:\n    def reset(self, row): pass\n    def step(self, text): return 1.0\n"
            "def make(): return E()\n",
            "step\\(\\) returned float, not envs.base.StepResult",
        ),
        (
            "from loopline.envs.base import StepResult\n"
            "class E:\n    async def reset(self, row): pass\n"
            "    async def step(self, text): return StepResult('tool says 4', 0.0, False)\n"
            "def make(): return E()\n",
            "did not end after one response",
        ),
    ],
)
def test_a_misbehaving_env_is_named_with_the_prompt(tmp_path: Path, body: str, error: str) -> None:
    name = _user_env(tmp_path, body)
    with pytest.raises(EnvError, match=rf"env 'python:.*:make' on prompt 1 \('2\+2='\).*{error}"):
        score_chunk(name, (["4"], [ROWS[1]]))


def test_a_user_env_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    with pytest.raises(EnvError, match="no file"):
        env_factory(f"python:{tmp_path / 'missing.py'}:make")
    with pytest.raises(EnvError, match="cannot import no_such_pkg.envs: ModuleNotFoundError"):
        env_factory("python:no_such_pkg.envs:make")
    with pytest.raises(EnvError, match="has no callable 'make'"):
        env_factory(_user_env(tmp_path, "make = 3\n"))
    with pytest.raises(EnvError, match="cannot import .*ZeroDivisionError"):
        env_factory(_user_env(tmp_path, "1 / 0\n"))


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("adition", "unknown env 'adition': use one of addition, exact_match, math"),
        ("python:pkg.mod", "unknown env"),  # no factory
    ],
)
def test_config_names_a_bad_env(name: str, error: str) -> None:
    with pytest.raises(ConfigError, match=rf"env\.name.*{error}"):
        load_config(overrides=[f"env.name={name}"])


def test_an_env_that_reads_row_fields_the_builtin_rows_lack_needs_a_file_dataset(tmp_path: Path) -> None:
    """The built-in rows have only what their task writes (the code task: entry_point and test): an env that reads
    more (MBPP's test_list, a user env's env.fields) is refused when the config loads, naming the fields, not at
    the first score after SFT. The example config of the built-in code task loads."""
    with pytest.raises(ConfigError, match=r"env.name=code reads the fields test_list of each row"):
        load_config(overrides=["env.name=code", "env.code_format=mbpp"])
    with pytest.raises(ConfigError, match=r"env.name=code reads the fields meta of each row"):
        load_config(overrides=["env.name=code", "env.fields=[meta]"])
    with pytest.raises(ConfigError, match=r"reads the fields meta of each row"):
        load_config(overrides=["env.name=math", "env.fields=[meta]"])
    example = load_config(Path(__file__).parents[2] / "examples" / "code_task.yaml")
    assert (example.env.name, example.data.source) == ("code", "builtin")
    assert example.env.row_fields == ("entry_point", "test")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    cfg = load_config(overrides=["env.name=code", "data.source=jsonl", f"data.train_path={rows}"])
    assert cfg.env.row_fields == ("entry_point", "test") and not cfg.env.reads_answer


@pytest.mark.parametrize(
    ("test", "error"),
    [
        ("def check(candidate):\n    assert candidate( == 1\n", "not valid Python"),
        ("assert True\n", "no check"),
    ],
)
def test_a_code_row_whose_test_cannot_check_anything_is_named(test: str, error: str) -> None:
    row = PromptRow(index=3, prompt="def f():\n", extra=(("entry_point", "f"), ("test", test)))
    with pytest.raises(
        EnvError, match=rf"env 'code' on prompt 3 .* raised ValueError: the row's test .*{error}"
    ):
        score_chunk("code", (["    return 1\n"], [row]))


@pytest.mark.sandbox  # the code env's tests run in the sandbox (the rest of this module: unit)
def test_the_code_env_scores_mbpp_rows_and_their_fields_are_its_own() -> None:
    env = EnvConfig(name="code", code_format="mbpp", code_reward="fraction")
    assert env.row_fields == ("test_list",) and not env.reads_answer
    assert env.optional_row_fields == ("test_imports", "test_setup_code")
    asserts = ["assert double(2) == 4", "assert double(0) == 0", "assert double(-1) == -2"]
    row = PromptRow(
        index=0, prompt="Write a function double(x).", extra=(("test_list", json.dumps(asserts)),)
    )
    texts = ["def double(x):\n    return 2 * x\n", "def double(x):\n    return x + 2 if x > 0 else x\n"]
    verdicts = score_chunk(env, (texts, [row, row]))
    assert rewards(verdicts) == [1.0, pytest.approx(2 / 3)]  # wrong on -1 only
    assert [v.correct for v in verdicts] == [True, False]  # pass@1: every test
    imported = PromptRow(
        index=1,
        prompt="Write a function root(x).",
        extra=(
            ("test_list", json.dumps(["assert root(9) == 3"])),
            ("test_imports", json.dumps(["import math"])),
        ),
    )
    assert rewards(score_chunk(env, (["def root(x):\n    return math.isqrt(x)\n"], [imported]))) == [1.0]
    bad = PromptRow(index=3, prompt="p", extra=(("test_list", json.dumps(["assert True"])),))
    with pytest.raises(EnvError, match=r"env 'code' on prompt 3 .*calls no function"):
        score_chunk(env, (["x = 1\n"], [bad]))


def test_the_tool_example_env_runs_its_tool_between_turns() -> None:
    """examples/my_tool_env.py, as the RL loop's env workers step it: each turn's history replayed on a fresh env."""
    env = EnvConfig(name=f"python:{EXAMPLE.with_name('my_tool_env.py')}:make_env", max_turns=3)
    row = PromptRow(index=0, prompt="What is the digit sum of 98765?\n", answer="35")
    call = '<tool_call>{"name": "digit_sum", "arguments": {"n": 98765}}</tool_call>'
    reset, called, answered, wrong = step_chunk(
        env, Histories([row] * 4, [[], [call], [call, "<answer>35</answer>"], [call, "<answer>36</answer>"]])
    )
    assert reset.observation == row.prompt and not reset.done
    assert called.observation == "<tool_result>35</tool_result>" and not called.done and called.reward == 0
    assert called.info["tool_calls_ok"] == 1
    assert (answered.done, answered.reward, wrong.done, wrong.reward) == (True, 1.0, True, 0.0)


def test_a_chunks_time_limit_is_what_the_envs_own_limits_allow_its_episodes() -> None:
    """Code: the sandbox's limit per wave of 5 episodes at once (the fewest threads asyncio.to_thread has), half
    again for the sandbox's start and end; agents: all at once, each up to env.agent_timeout_s; other envs: 0."""
    code = EnvConfig(name="code", sandbox=SandboxConfig(timeout_s=10.0))
    assert [chunk_time_limit(code, n) for n in (1, 5, 6, 256)] == [15.0, 15.0, 30.0, 52 * 15.0]
    agent = EnvConfig(name="openai_agent", command="python agent.py", agent_timeout_s=90.0)
    assert chunk_time_limit(agent, 1) == chunk_time_limit(agent, 300) == 90.0
    assert (
        chunk_time_limit(EnvConfig(name="addition"), 512)
        == chunk_time_limit(EnvConfig(name="calculator"), 9)
        == 0
    )
