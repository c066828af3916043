"""Environments of the libraries users already have, through loopline's adapters (envs/verifiers_env.py,
envs/openenv_env.py): small envs written with verifiers and OpenEnv themselves, stepped the way the env workers step
them (envs.episodes: score and step tasks, each episode replayed on a fresh env), their rewards hand-checked
against their rubric or their observations, their turns as the library runs them; bad names fail with one line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loopline.config import load_config
from loopline.data.rows import PromptRow
from loopline.envs.config import EnvConfig
from loopline.envs.episodes import EnvError, Histories, builtin_rows, env_factory, score_chunk, step_chunk
from loopline.envs.library import require
from loopline.section import ConfigError
from tests.conftest import need_module

need_module("verifiers", "the envs extra (pip install 'loopline[envs]')")
need_module("openenv.core.env_server.interfaces", "the envs extra (pip install 'loopline[envs]')")

# A verifiers SingleTurnEnv (exact answer, weight 1; a one-line answer, weight 0.5) and a ToolEnv (a lookup tool,
# the answer after its result), each with its own dataset.
VERIFIERS = '''
import verifiers as vf
from datasets import Dataset


def exact(completion, answer, **kwargs):
    return 1.0 if (completion[-1].content or "").strip().split("\\n")[0] == answer else 0.0


def one_line(completion, **kwargs):
    return 0.0 if "\\n" in (completion[-1].content or "").strip() else 1.0


def load_environment():
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(5)]
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows[:24]),
        eval_dataset=Dataset.from_list(rows[24:]),
        system_prompt="Add.",
        rubric=vf.Rubric(funcs=[exact, one_line], weights=[1.0, 0.5]),
    )


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return {"a": "7", "b": "9"}[key]


def answered(completion, answer, **kwargs):
    return 1.0 if (completion[-1].content or "").strip() == answer else 0.0


def tools():
    rows = [{"question": "What is a?", "answer": "7"}, {"question": "What is b?", "answer": "9"}]
    return vf.ToolEnv(tools=[lookup], max_turns=3, dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[answered]))


def group_scored():
    def best_of_group(completions, **kwargs) -> list[float]:
        return [1.0] * len(completions)

    return vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": "q", "answer": "a"}]),
                            rubric=vf.Rubric(funcs=[best_of_group]))


not_an_env = 3
'''

# An OpenEnv environment class: guess a digit (seeded), told higher or lower, three guesses.
OPENENV = """
import random

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    feedback: str


class GuessNumber(Environment[GuessAction, GuessObservation, State]):
    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = random.Random(seed).randint(0, 9)
        self._state = State(step_count=0)
        return GuessObservation(feedback=f"Guess a digit ({seed % 7}).")

    def step(self, action: GuessAction, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.guess == self.target:
            return GuessObservation(feedback="right", done=True, reward=1.0)
        hint = "higher" if action.guess < self.target else "lower"
        return GuessObservation(feedback=hint, done=self._state.step_count >= 3, reward=0.0)

    @property
    def state(self):
        return self._state
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("library_envs")
    (root / "vf_envs.py").write_text(VERIFIERS)
    (root / "oe_guess.py").write_text(OPENENV)
    return root / "vf_envs.py", root / "oe_guess.py"


def test_a_verifiers_single_turn_env_brings_its_rows_and_its_rubric_scores(files: tuple[Path, Path]) -> None:
    env = EnvConfig(name=f"verifiers:{files[0]}")
    assert env.has_builtin_rows and env.turns == 1
    train, held_out, val = builtin_rows(env, seed=0)
    assert (len(train), len(held_out), val) == (24, 6, [])
    row = train[7]  # 1+2=3: the system prompt and the question, as one text prompt
    assert (row.prompt, row.answer) == ("Add.\n\n1+2=", "3")
    assert held_out[0].prompt == "Add.\n\n4+4=" and held_out[0].answer == "8"
    verdicts = score_chunk(env, (["3", "3\nmore", "4", "4\nmore"], [row] * 4))
    # reward = 1.0 * exact + 0.5 * one_line; correct = reward >= verifiers' pass_threshold (0.5)
    assert [v.reward for v in verdicts] == [1.5, 1.0, 0.5, 0.0]
    assert [v.correct for v in verdicts] == [True, True, True, False]
    # a file's row (no verifiers input of its own): its prompt, as the user message, and its answer
    assert score_chunk(env, (["3"], [PromptRow(0, "1+2=", answer="3")])) == [(1.5, True)]


def test_a_verifiers_tool_env_runs_its_turns_as_verifiers_does(files: tuple[Path, Path]) -> None:
    env = EnvConfig(name=f"verifiers:{files[0]}:tools", max_turns=3)
    row = builtin_rows(env, seed=0)[0][0]
    assert row.prompt.startswith("You can call these tools:\n") and row.prompt.endswith("\n\nWhat is a?")
    assert (
        '"name": "lookup"' in row.prompt
    )  # the tool's definition, as verifiers derives it from the function
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
    bad = '<tool_call>{"name": "lookup", "arguments": {"key": "zz"}}</tool_call>'
    first, tool, answer, wrong, error = step_chunk(
        env, Histories([row] * 5, [[], [call], [call, "7"], [call, "8"], [bad]])
    )
    assert (first.observation, first.done) == (row.prompt, False)
    assert (tool.observation, tool.reward, tool.done) == ("<tool_result>7</tool_result>", 0.0, False)
    # a turn without a tool call ends it (ToolEnv's no_tools_called); the rubric pays then, with its metrics
    assert (answer.reward, answer.done, answer.info["correct"]) == (1.0, True, 1.0)
    assert answer.info["vf_num_turns"] == 2 and answer.info["vf_total_tool_calls"] == 1
    assert answer.info["vf_lookup_calls"] == 1 and answer.info["vf_answered"] == 1
    assert (wrong.reward, wrong.info["correct"]) == (0.0, 0.0)
    assert (error.observation, error.done) == (
        "<tool_result>'zz'</tool_result>",
        False,
    )  # the tool's KeyError


def test_an_openenv_env_is_reset_with_a_seed_per_row_and_stepped_with_actions(
    files: tuple[Path, Path],
) -> None:
    name = f"openenv:{files[1]}"
    env = EnvConfig(name=name, max_turns=3, openenv={"num_train": 5, "num_eval": 2})
    train, held_out, _ = builtin_rows(env, seed=0)
    assert [r.prompt for r in train] == [f"Guess a digit ({s % 7})." for s in range(5)]
    assert [r.prompt for r in held_out] == [f"Guess a digit ({s % 7})." for s in (1_000_000, 1_000_001)]
    target = random.Random(3).randint(0, 9)  # row 3's episode: seed 3
    low, high = ("higher", str(target - 1)) if target > 0 else ("lower", str(target + 1))
    first, hint, right, invalid, out = step_chunk(
        env,
        Histories([train[3]] * 5, [[], [high], [high, str(target)], ["a digit"], [high, high, high]]),
    )
    assert (first.observation, first.done) == ("Guess a digit (3).", False)
    assert (hint.observation, hint.reward, hint.done) == (low, 0.0, False)
    assert (right.reward, right.done, right.info["correct"]) == (1.0, True, 1.0)
    assert (invalid.reward, invalid.done, invalid.info["invalid_action"]) == (0.0, True, 1)
    assert (out.reward, out.done, out.info["correct"]) == (0.0, True, 0.0)  # three wrong guesses end it
    assert [v.reward for v in score_chunk(EnvConfig(name=name), ([str(target)], [train[3]]))] == [1.0]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("verifiers:nope", "env.name=verifiers:nope: cannot import nope: ModuleNotFoundError"),
        ("verifiers:{vf}:missing", "has no 'missing'"),
        ("verifiers:{vf}:not_an_env", "not_an_env is neither a vf.Environment nor a function returning one"),
        ("verifiers:{vf}:lookup", "lookup() raised TypeError"),
        ("verifiers:{vf}:group_scored", "group reward functions"),
        ("openenv:nope.envs", "env.name=openenv:nope.envs: cannot import nope.envs: ModuleNotFoundError"),
        ("openenv:{vf}", "name the Environment class (openenv:MODULE:NAME); the module defines 0 (none)"),
    ],
)
def test_a_bad_library_env_fails_with_one_line(files: tuple[Path, Path], name: str, message: str) -> None:
    with pytest.raises(EnvError, match=None) as raised:
        env_factory(EnvConfig(name=name.format(vf=files[0])))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_missing_library_names_the_extra_that_installs_it() -> None:
    with pytest.raises(EnvError) as raised:
        require("verifiers:my_env", "verifiers_not_installed_here")
    assert str(raised.value).startswith(
        "env.name=verifiers:my_env runs an environment of the verifiers library"
    )
    assert str(raised.value).endswith("pip install 'loopline[envs]'")


def test_library_env_names_are_checked_and_files_stored_absolute(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(files[0].parent)
    assert EnvConfig(name="verifiers:vf_envs.py:tools").name == f"verifiers:{files[0]}:tools"
    assert EnvConfig(name="openenv:oe_guess.py").name == f"openenv:{files[1]}"
    assert EnvConfig(name="verifiers:pkg.mod").name == "verifiers:pkg.mod"
    with pytest.raises(ValueError, match="verifiers:MODULE\\[:NAME\\]"):
        EnvConfig(name="verifiers:")
    with pytest.raises(ConfigError, match="takes data.source=builtin, not jsonl"):
        load_config(None, ["env.name=openenv:oe_guess.py", "data.source=jsonl", "data.train_path=x.jsonl"])
