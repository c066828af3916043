"""A built-in env is one spec (envs.config.ENVS) and its code in envs/: registering a throwaway one makes it a valid
env.name, checked with the rest of the config, and scores completions, with nothing outside envs/ edited."""

from __future__ import annotations

import functools

import pytest

from loopline.config import ConfigError, load_config
from loopline.data.rows import PromptRow
from loopline.envs.base import VerifierEnv
from loopline.envs.config import ENVS, EnvConfig, EnvSpec
from loopline.envs.episodes import EnvFactory, builtin_rows, score_chunk


def says_yes_env(env: EnvConfig) -> EnvFactory:
    """The throwaway env: reward 1 when the first line of the response is 'yes'."""
    return functools.partial(VerifierEnv, lambda text, answer: float(text.splitlines()[0] == "yes"))


def yes_rows(env: EnvConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow], list[PromptRow]]:
    rows = [PromptRow(i, f"question {seed}-{i}?", "yes", extra={"lang": "en"}) for i in range(12)]
    return rows[:8], rows[8:10], rows[10:]


@pytest.fixture
def yes_env(monkeypatch: pytest.MonkeyPatch) -> EnvSpec:
    spec = EnvSpec(
        "a throwaway: the response says yes",
        f"{__name__}:says_yes_env",
        builtin_rows=f"{__name__}:yes_rows",
        row_fields=("lang",),
        max_turns=2,
        stop=("</yes>",),
    )
    monkeypatch.setitem(ENVS, "says_yes", spec)
    return spec


@pytest.mark.unit
def test_a_registered_spec_is_an_env_name_the_config_checks(yes_env: EnvSpec):
    cfg = load_config(overrides=["env.name=says_yes"])
    assert cfg.env.spec is yes_env and cfg.env.row_fields == ("lang",)
    assert cfg.env.turns == 2 and cfg.env.multi_turn and cfg.env.turn_stop == ("</yes>",)
    # its own rows carry the field it reads
    assert cfg.env.has_builtin_rows and cfg.env.builtin_row_fields == ("lang",)
    # a field the built-in rows lack is refused at load, naming the env and the field
    with pytest.raises(ConfigError, match=r"env.name=says_yes reads the fields topic of each row"):
        load_config(overrides=["env.name=says_yes", "env.fields=[topic]"])


@pytest.mark.unit
def test_a_registered_spec_scores_and_serves_its_own_rows(yes_env: EnvSpec):
    env = EnvConfig(name="says_yes")
    train, held_out, val = builtin_rows(env, seed=3)
    assert [len(train), len(held_out), len(val)] == [8, 2, 2] and train[0].prompt == "question 3-0?"
    verdicts = score_chunk(env, (["yes\nbecause", "no"], train[:2]))
    assert [v.reward for v in verdicts] == [1.0, 0.0]


@pytest.mark.unit
def test_an_unregistered_name_is_refused():
    with pytest.raises(ConfigError, match="unknown env 'says_yes'"):
        load_config(overrides=["env.name=says_yes"])
