"""OpenEnv environments in loopline's loop: env.name=openenv:MODULE_OR_FILE[:NAME].

NAME is an OpenEnv `Environment` subclass (default: the module's only one) or a function returning a fresh
instance, called with no arguments: in process, on the env workers (no server, no docker, no HTTP). What maps onto
loopline's episodes:
- rows: the episodes are the env's resets, one seed per row (its reset(seed=...) must make the same episode for the
  same seed: loopline replays episodes). data.source=builtin (required) makes env.openenv.num_train training rows
  (seeds 0, 1, ...) and num_eval held-out ones (seeds from 1000000); a row's prompt is its reset's observation.
- action: the model's turn becomes the env's Action: an Action with one required field gets the text in it (a
  non-string field, e.g. `guess: int`, parses it); any other Action is read from a JSON object in the text (a
  tool call's arguments `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, else the text's outermost
  {...}). A turn that makes no valid Action ends the episode with reward 0 and `invalid_action` 1 in its info.
- observation: the Observation's fields but done, reward and metadata are the next observation's text (one field:
  its value; several: a JSON object); its reward is the turn's reward (None: 0), its done ends the episode.
- correct: the env's `max_reward` class attribute (default 1) reached by the episode's return
  (envs.base.counts_correct), or a `correct` entry in the last observation's metadata.
Not mapped: OpenEnv's HTTP/WebSocket clients and containers (use the Environment class itself), transforms' and
rubrics' state across episodes, and the env's own state() (loopline keeps none).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import typing
from collections.abc import Callable
from typing import Any

from loopline.data.rows import PromptRow
from loopline.envs.base import MAX_REWARD, StepResult
from loopline.envs.config import EnvConfig
from loopline.envs.episodes import EnvError, EnvFactory
from loopline.envs.library import named, require
from loopline.rollout.tool_calls import ToolCall, ToolsConfig, parse_tool_calls

SEED_FIELD = "openenv_seed"  # the row's extra field holding its reset seed
EVAL_SEEDS = 1_000_000  # held-out seeds start here, past any training split
_BASE_FIELDS = ("done", "reward", "metadata")  # an Observation's own fields; the rest are what it shows


@functools.cache
def environment_maker(name: str) -> Callable[[], Any]:
    """What makes a fresh environment of env.name=`name`: its Environment class, or the function NAME."""
    interfaces = require(name, "openenv.core.env_server.interfaces")
    base = interfaces.Environment
    attr, obj = named(name, None)
    if not attr:  # no NAME: the module's one Environment class
        found = [
            v
            for v in vars(obj).values()
            if isinstance(v, type) and issubclass(v, base) and v is not base and v.__module__ == obj.__name__
        ]
        if len(found) != 1:
            which = ", ".join(c.__name__ for c in found) or "none"
            raise EnvError(
                f"env.name={name}: name the Environment class (openenv:MODULE:NAME); the module defines "
                f"{len(found)} ({which})"
            )
        return found[0]
    if not callable(obj) or inspect.isabstract(obj):
        raise EnvError(f"env.name={name}: {attr} is not an Environment class or a function returning one")
    return obj


def openenv_env(env: EnvConfig) -> EnvFactory:
    """env.name=openenv:...: a fresh episode (a fresh environment) per call."""
    return functools.partial(OpenEnvEpisode, environment_maker(env.name), env.name)


def openenv_rows(env: EnvConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow], list[PromptRow]]:
    """data.source=builtin: env.openenv.num_train training episodes and num_eval held-out ones, each a reset seed
    and its first observation; no validation split."""
    make = environment_maker(env.name)
    train = range(env.openenv.num_train)
    held_out = range(EVAL_SEEDS, EVAL_SEEDS + env.openenv.num_eval)
    return _rows(env.name, make, train), _rows(env.name, make, held_out), []


def _rows(name: str, make: Callable[[], Any], seeds: range) -> list[PromptRow]:
    async def first(seed: int) -> str:
        episode = OpenEnvEpisode(make, name)
        return await episode.reset(PromptRow(seed - seeds.start, "", extra=((SEED_FIELD, str(seed)),)))

    async def all_first() -> list[str]:
        return list(await asyncio.gather(*(first(s) for s in seeds)))

    try:
        observations = asyncio.run(all_first())
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"env.name={name}: reset raised {type(e).__name__}: {e}") from e
    return [
        PromptRow(i, text, extra=((SEED_FIELD, str(s)),))
        for i, (s, text) in enumerate(zip(seeds, observations, strict=True))
    ]


def _seed(row: PromptRow) -> int:
    """The row's reset seed (its own field; a row without one: its position)."""
    held = row.get(SEED_FIELD)
    return int(held) if held else row.index


# ---------------------------------------------------------------------------------------------
# Text <-> Action, Observation -> text
# ---------------------------------------------------------------------------------------------


@functools.cache
def action_class(env_class: type) -> type:
    """The Action model an environment class steps with: its step's annotation, else its Environment[...] base's."""
    hint = typing.get_type_hints(env_class.step).get("action")
    if isinstance(hint, type) and hasattr(hint, "model_validate"):
        return hint
    for base in getattr(env_class, "__orig_bases__", ()):
        for arg in typing.get_args(base):
            if isinstance(arg, type) and hasattr(arg, "model_validate") and arg.__name__.endswith("Action"):
                return arg
    raise EnvError(
        f"{env_class.__name__}: cannot tell its Action class: annotate step(self, action: MyAction, ...)"
    )


def to_action(cls: type, text: str) -> Any:
    """The model's turn as an Action of `cls` (ValueError, or pydantic's ValidationError, when it makes none)."""
    fields = {k: f for k, f in cls.model_fields.items() if k != "metadata"}  # type: ignore[attr-defined]
    required = [k for k, f in fields.items() if f.is_required()]
    if len(required) == 1:
        (key,) = required
        return cls.model_validate({key: text if fields[key].annotation is str else text.strip()})  # type: ignore[attr-defined]
    calls = [c for c in parse_tool_calls(text, ToolsConfig()) if isinstance(c, ToolCall)]
    if calls:
        return cls.model_validate(calls[0].arguments)  # type: ignore[attr-defined]
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the text")
    return cls.model_validate(json.loads(text[start : end + 1]))  # type: ignore[attr-defined]


def observation_text(observation: Any) -> str:
    """What an Observation shows: its one field's value, or its fields as a JSON object (done, reward and metadata
    apart)."""
    shown = {k: v for k, v in observation.model_dump().items() if k not in _BASE_FIELDS}
    if len(shown) == 1:
        (value,) = shown.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(shown) if shown else ""


# ---------------------------------------------------------------------------------------------
# One episode as an envs.base.Env
# ---------------------------------------------------------------------------------------------


class OpenEnvEpisode:
    """One episode of an OpenEnv environment as an envs.base.Env: a fresh environment, reset with the row's seed,
    stepped with each model turn as its Action."""

    def __init__(self, make: Callable[[], Any], name: str) -> None:
        self.make, self.name = make, name
        self.max_reward = float(getattr(make, "max_reward", MAX_REWARD))

    async def reset(self, sample: PromptRow) -> str:
        """A fresh environment, reset with the row's seed; its observation as text."""
        self.env = self.make()
        self.max_reward = float(getattr(self.env, "max_reward", self.max_reward))
        self._action = action_class(type(self.env))
        return observation_text(await self.env.reset_async(seed=_seed(sample)))

    async def step(self, action: str) -> StepResult:
        """The model's turn as the env's Action, stepped; what it observes next, its reward and done."""
        try:
            act = to_action(self._action, action)
        except ValueError:  # pydantic's ValidationError and json's JSONDecodeError are ValueErrors
            self.env.close()
            return StepResult("", 0.0, True, {"invalid_action": 1})
        observation = await self.env.step_async(act)
        reward = float(observation.reward or 0.0)
        info: dict[str, float | int | str] = {}
        metadata = observation.metadata or {}
        if observation.done:
            self.env.close()
            if isinstance(metadata.get("correct"), int | float):
                info["correct"] = float(metadata["correct"])
            return StepResult("", reward, True, info)
        return StepResult(observation_text(observation), reward, False, info)
