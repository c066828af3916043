"""The env workers' task in the RL loop: episodes of the configured env (`env.name`), one per completion.

A task is a chunk of a step's completions with their prompt rows; each gets a fresh env from the env's factory,
`reset(row)`, `step(completion)`, and its reward. The chunk's episodes run concurrently (one event loop), so an
env that waits on a tool or a sandbox does not hold the others. Imports neither torch nor transformers: a worker
starts in about a second (the code env's first episode also starts the worker's sandbox).

An env that raises, returns a reward that is not a finite number, or does not end after the one response fails
the chunk with an EnvError naming the env and the prompt; the pool reports it (runtime.scorer) and the step
fails loudly. A worker that dies or hangs is the pool's to replace, and the chunk is retried elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path

from loopline.data.rows import PromptRow
from loopline.data.tasks import exact_match
from loopline.envs.base import Env, StepResult, VerifierEnv
from loopline.envs.config import BUILTIN_ENVS, USER_ENV, EnvConfig
from loopline.envs.math_equal import math_reward
from loopline.errors import UserError

EnvFactory = Callable[[], Env]
Chunk = tuple[list[str], list[PromptRow]]  # completion texts and the row each answers


class EnvError(UserError):
    """An env could not be made, or misbehaved on an episode; the message names the env (and the prompt)."""


def _builtin(env: EnvConfig) -> EnvFactory:
    if env.name == "code":
        from loopline.envs.code import CodeEnv

        return functools.partial(CodeEnv, env.sandbox, tally=env.code_reward == "fraction")
    verify = math_reward if env.name == "math" else exact_match  # addition and exact_match: the first line
    return functools.partial(VerifierEnv, verify)


def _load_module(spec: str, name: str):  # -> types.ModuleType
    """A dotted module name, or a path to a .py file (imported once per process under a name of its own)."""
    if not spec.endswith(".py"):
        return importlib.import_module(spec)
    path = Path(spec).resolve()
    key = f"loopline_user_env_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if key in sys.modules:
        return sys.modules[key]
    if not path.is_file():
        raise EnvError(f"env.name={name}: no file {path}")
    module_spec = importlib.util.spec_from_file_location(key, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[key] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module


def env_factory(env: EnvConfig | str) -> EnvFactory:
    """The factory of `env` (the env section, or just its name): a built-in, or python:MODULE:FACTORY imported
    here. Made once per process and config."""
    env = EnvConfig(name=env) if isinstance(env, str) else env
    return _factory(env.model_dump_json())


@functools.cache
def _factory(env_json: str) -> EnvFactory:
    env = EnvConfig.model_validate_json(env_json)
    name = env.name
    if name in BUILTIN_ENVS:
        return _builtin(env)
    match = USER_ENV.match(name)
    if match is None:
        raise EnvError(f"unknown env {name!r}")
    try:
        module = _load_module(match["module"], name)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"env.name={name}: cannot import {match['module']}: {type(e).__name__}: {e}") from e
    factory = getattr(module, match["factory"], None)
    if not callable(factory):
        raise EnvError(f"env.name={name}: {match['module']} has no callable {match['factory']!r}")
    return factory


def _prompt(row: PromptRow) -> str:
    text = row.prompt or (row.messages[-1]["content"] if row.messages else "")
    return repr(text if len(text) <= 60 else text[:57] + "...")


async def _episode(name: str, factory: EnvFactory, text: str, row: PromptRow) -> float:
    where = f"env '{name}' on prompt {row.index} ({_prompt(row)})"
    try:
        env = factory()
        started = env.reset(row)
        if inspect.isawaitable(started):  # the protocol's methods are async; plain ones are accepted too
            await started
        result = env.step(text)
        if inspect.isawaitable(result):
            result = await result
    except Exception as e:
        raise EnvError(f"{where} raised {type(e).__name__}: {e}") from e
    if not isinstance(result, StepResult):
        raise EnvError(f"{where}: step() returned {type(result).__name__}, not envs.base.StepResult")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvError(f"{where}: reward {reward!r} is not a finite number")
    if not result.done:
        raise EnvError(
            f"{where}: the episode did not end after one response (multi-turn envs are not in the RL loop yet)"
        )
    return float(reward)


async def _episodes(env: EnvConfig, texts: list[str], rows: list[PromptRow]) -> list[float]:
    factory = env_factory(env)
    return list(
        await asyncio.gather(*(_episode(env.name, factory, t, r) for t, r in zip(texts, rows, strict=True)))
    )


def score_chunk(env: EnvConfig | str, chunk: Chunk) -> list[float]:
    """One env pool task: the reward of each completion of `chunk` under `env` (its section, or a name), in order."""
    texts, rows = chunk
    return asyncio.run(_episodes(EnvConfig(name=env) if isinstance(env, str) else env, texts, rows))
