"""A plain reward function as an env (envs.reward_fn): told apart from an env factory by its signature, given the
row's fields it names, and a wrong return or a field the rows lack fails the episode naming why."""

from __future__ import annotations

import asyncio

import pytest

from loopline.data.rows import PromptRow
from loopline.envs.episodes import EnvError, score_chunk
from loopline.envs.reward_fn import RewardFnEnv, is_reward_fn

ROW = PromptRow(index=0, prompt="2+3=", answer="5", extra=(("topic", "sums"),))


def test_a_reward_function_is_told_from_a_factory() -> None:
    assert is_reward_fn(lambda prompt, completion: 1.0)
    assert is_reward_fn(lambda prompt, completion, answer, **row: 1.0)
    assert not is_reward_fn(lambda: None)  # a factory
    assert not is_reward_fn(lambda seed=0: None)  # a factory with a default
    assert not is_reward_fn(RewardFnEnv.__init__.__get__(object()))  # one argument: neither


def _score(fn) -> float:  # noqa: ANN001
    env = RewardFnEnv(fn)
    assert asyncio.run(env.reset(ROW)) == "2+3="
    result = asyncio.run(env.step("5\n"))
    assert result.done
    return result.reward


def test_fields_by_name_or_all() -> None:
    assert _score(lambda prompt, completion, answer: float(completion.strip() == answer)) == 1.0
    assert _score(lambda prompt, completion, **row: float(row == {"answer": "5", "topic": "sums"})) == 1.0
    assert _score(lambda prompt, completion, topic, missing="x": float(topic + missing == "sumsx")) == 1.0
    assert _score(lambda p, c: True) == 1.0  # a bool is a number


def test_a_field_the_rows_lack_or_a_wrong_return_fails_with_why() -> None:
    with pytest.raises(
        TypeError, match="takes test, which the rows do not carry .*add the field to env.fields"
    ):
        _score(lambda prompt, completion, test: 1.0)
    with pytest.raises(TypeError, match="returned str '1', not a number"):
        _score(lambda prompt, completion: "1")


def test_env_name_python_file_function_scores_through_the_env_path(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "mine.py").write_text(
        "def close(prompt, completion, answer):\n    return 1.0 if completion == answer else 0.25\n"
    )
    name = f"python:{tmp_path / 'mine.py'}:close"
    verdicts = score_chunk(name, (["5", "6"], [ROW, ROW]))
    assert [v.reward for v in verdicts] == [1.0, 0.25]
    assert [v.correct for v in verdicts] == [True, False]  # full marks only: 0.25 is partial credit
    (tmp_path / "bad.py").write_text("def bad(prompt, completion):\n    return None\n")
    with pytest.raises(EnvError, match="raised TypeError at turn 1: the reward function returned NoneType"):
        score_chunk(f"python:{tmp_path / 'bad.py'}:bad", (["5"], [ROW]))
