"""The env workers' task in the RL loop: episodes of the configured env (`env.name`), one per completion.

Two kinds of task, both run here (on an env worker) and both a pure function of what they are sent:
- score: a chunk of single-turn completions with their prompt rows; each gets a fresh env from the env's factory,
  `reset(row)`, `step(completion)`, and its verdict: the reward, and whether it counts as correct
  (envs.base.counts_correct, where the env is).
- step: a chunk of multi-turn episodes as (row, every action so far); each is replayed on a fresh env (reset, then
  every action) and the last StepResult comes back: the next observation, reward and done. The driver
  (envs.multiturn) sends each episode again every turn with one more action. Replaying makes a step a pure
  function of its history, so any worker can take it and a lost worker's chunk is simply sent again; the price is
  that an env's steps must depend only on the row and the actions (not on time or chance), and that an episode of
  T turns steps its env T(T+1)/2 times (microseconds for a tool like the calculator).
A chunk's episodes run concurrently (one event loop), so an env that waits on a tool or a sandbox does not hold
the others. Imports neither torch nor transformers: a worker starts in about a second.

An env that raises, returns a reward that is not a finite number, ends a single-turn episode late or a multi-turn
one early fails the chunk with an EnvError naming the env and the prompt; the pool reports it (runtime.scorer) and
the step fails loudly. A worker that dies or hangs is the pool's to replace, and the chunk is retried elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import pickle
import random
import signal
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from loopline.data.rows import PromptRow
from loopline.data.tasks import exact_match
from loopline.envs.base import Env, StepResult, VerifierEnv, counts_correct, max_reward
from loopline.envs.config import USER_ENV, EnvConfig
from loopline.envs.math_equal import math_reward
from loopline.envs.reward_fn import RewardFnEnv, is_reward_fn
from loopline.errors import UserError

EnvFactory = Callable[[], Env]
Chunk = tuple[list[str], list[PromptRow]]  # completion texts and the row each answers


class Verdict(NamedTuple):
    """A single-turn episode's outcome: its reward, and whether it counts as correct (envs.base.counts_correct)."""

    reward: float
    correct: bool


@dataclass(frozen=True)
class AgentRuns:
    """An agent task (env.name=openai_agent): one run of the agent program per row, against the endpoint at
    base_url, each authenticating with its episode's id."""

    rows: list[PromptRow]
    episode_ids: list[str]
    base_url: str


@dataclass(frozen=True)
class Histories:
    """A step task: multi-turn episodes as their rows and the actions taken so far (none: just reset)."""

    rows: list[PromptRow]
    actions: list[list[str]]


class EnvError(UserError):
    """An env could not be made, or misbehaved on an episode; the message names the env (and the prompt)."""


def verifier_env(env: EnvConfig) -> EnvFactory:
    """addition and exact_match: the first line equals the answer (openai_agent's episodes are runs of env.command,
    run_agents, so its factory is never stepped)."""
    return functools.partial(VerifierEnv, exact_match)


def math_env(env: EnvConfig) -> EnvFactory:
    """math: the final answer is mathematically equal to the row's (envs.math_equal)."""
    return functools.partial(VerifierEnv, math_reward)


def _named(target: str) -> Callable:
    """The function a spec names as "module:function", imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def env_demonstration(env: EnvConfig, row: PromptRow, rng: random.Random) -> list[str] | None:
    """The env's own demonstration of `row` for multi-turn SFT (its spec's), as action texts; None: the row's
    target is the one action."""
    if env.spec is None or env.spec.demonstration is None:
        return None
    return _named(env.spec.demonstration)(env, row, rng)


def builtin_rows(env: EnvConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow], list[PromptRow]]:
    """data.source=builtin for an env with a task of its own (its spec's builtin_rows): train, held-out and
    validation rows."""
    assert env.spec is not None and env.spec.builtin_rows is not None, "only for env.has_builtin_rows"
    return _named(env.spec.builtin_rows)(env, seed)


def load_module(spec: str, name: str):  # -> types.ModuleType
    """A dotted module name, a path to a .py file (imported once per process under a name of its own), or a .pkl of a
    reward function pickled by value (loopline.api: a lambda, a notebook's function), served as the name `reward`."""
    if spec.endswith(".pkl"):
        if not Path(spec).is_file():
            raise EnvError(f"env.name={name}: no file {spec}")
        return types.SimpleNamespace(reward=pickle.loads(Path(spec).read_bytes()))
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


def import_env_module(module: str, name: str) -> types.ModuleType:
    """load_module for env.name=`name`, any failure but an EnvError turned into one line naming the module."""
    try:
        return load_module(module, name)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"env.name={name}: cannot import {module}: {type(e).__name__}: {e}") from e


@functools.cache
def _factory(env_json: str) -> EnvFactory:
    env = EnvConfig.model_validate_json(env_json)
    name = env.name
    if env.spec is not None:
        return _named(env.spec.factory)(env)
    match = USER_ENV.match(name)
    if match is None:
        raise EnvError(f"unknown env {name!r}")
    module = import_env_module(match["module"], name)
    factory = getattr(module, match["factory"], None)
    if not callable(factory):
        raise EnvError(f"env.name={name}: {match['module']} has no callable {match['factory']!r}")
    if is_reward_fn(factory):  # (prompt, completion, **row_fields) -> float: wrapped in a one-step env
        return functools.partial(RewardFnEnv, factory)
    return factory


def _prompt(row: PromptRow) -> str:
    text = row.prompt or (row.messages[-1]["content"] if row.messages else "")
    return repr(text if len(text) <= 60 else text[:57] + "...")


async def _call(method, *args):  # noqa: ANN001, ANN202 - an env's reset or step, async or plain
    result = method(*args)
    return await result if inspect.isawaitable(result) else result  # plain methods are accepted too


def _checked(where: str, result: object) -> StepResult:
    if not isinstance(result, StepResult):
        raise EnvError(f"{where}: step() returned {type(result).__name__}, not envs.base.StepResult")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvError(f"{where}: reward {reward!r} is not a finite number")
    correct = result.info.get("correct", 0) if isinstance(result.info, dict) else 0
    if not isinstance(correct, int | float):  # bool is an int
        raise EnvError(f"{where}: info['correct'] {correct!r} is not a number or bool (nonzero: correct)")
    return result


async def replay(
    name: str, factory: EnvFactory, row: PromptRow, actions: list[str], returns: str = "sum"
) -> StepResult:
    """One episode on a fresh env: reset on `row`, then every action; the last step's result (for no action,
    the first observation, not done). An episode that ended carries info['correct'] (envs.base.counts_correct on
    its return: the sum of its rewards, or with returns='final' the last)."""
    where = f"env '{name}' on prompt {row.index} ({_prompt(row)})"
    try:
        env = factory()
        observation = await _call(env.reset, row)
    except Exception as e:
        raise EnvError(f"{where} raised {type(e).__name__}: {e}") from e
    result, total = StepResult(str(observation), 0.0, False), 0.0
    for turn, action in enumerate(actions, 1):
        if result.done:
            raise EnvError(
                f"{where}: the episode ended at turn {turn - 1}, but its history has {len(actions)}"
            )
        try:
            result = _checked(where, await _call(env.step, action))
        except EnvError:
            raise
        except Exception as e:
            raise EnvError(f"{where} raised {type(e).__name__} at turn {turn}: {e}") from e
        total += result.reward
    if result.done:
        correct = counts_correct(result, total if returns == "sum" else result.reward, max_reward(env))
        result = replace(result, info={**result.info, "correct": float(correct)})
    return result


async def _episode(name: str, factory: EnvFactory, text: str, row: PromptRow) -> Verdict:
    result = await replay(name, factory, row, [text])
    if not result.done:
        where = f"env '{name}' on prompt {row.index} ({_prompt(row)})"
        raise EnvError(
            f"{where}: the episode did not end after one response (a multi-turn env needs env.max_turns > 1)"
        )
    return Verdict(float(result.reward), float(result.info["correct"]) > 0)


async def _episodes(env: EnvConfig, texts: list[str], rows: list[PromptRow]) -> list[Verdict]:
    factory = env_factory(env)
    return list(
        await asyncio.gather(*(_episode(env.name, factory, t, r) for t, r in zip(texts, rows, strict=True)))
    )


def score_chunk(env: EnvConfig | str, chunk: Chunk) -> list[Verdict]:
    """A score task: the verdict (reward, correct) of each completion of `chunk` under `env` (its section, or a
    name), in order."""
    texts, rows = chunk
    return asyncio.run(_episodes(EnvConfig(name=env) if isinstance(env, str) else env, texts, rows))


async def _steps(env: EnvConfig, chunk: Histories) -> list[StepResult]:
    factory = env_factory(env)
    replays = (
        replay(env.name, factory, r, a, env.returns) for r, a in zip(chunk.rows, chunk.actions, strict=True)
    )
    return list(await asyncio.gather(*replays))


def step_chunk(env: EnvConfig | str, chunk: Histories) -> list[StepResult]:
    """A step task: each episode of `chunk` replayed to its last action; their last results, in order."""
    return asyncio.run(_steps(EnvConfig(name=env) if isinstance(env, str) else env, chunk))


async def _agent(env: EnvConfig, row: PromptRow, episode: str, base_url: str) -> float:
    where = f"env '{env.name}' (command {env.command!r}) on prompt {row.index} ({_prompt(row)})"
    process = await asyncio.create_subprocess_shell(
        env.command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": episode},
        start_new_session=True,  # its whole process group is killed on a timeout
    )
    task = json.dumps({"index": row.index, "prompt": row.prompt, "answer": row.answer})
    try:
        out, err = await asyncio.wait_for(process.communicate(task.encode()), env.agent_timeout_s)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise EnvError(
            f"{where}: ran past env.agent_timeout_s ({env.agent_timeout_s:g}s) and was killed"
        ) from None
    if process.returncode != 0:
        tail = err.decode(errors="replace").strip()[-500:]
        raise EnvError(f"{where}: exited with status {process.returncode}: {tail}")
    lines = out.decode(errors="replace").strip().splitlines()
    return exact_match(lines[-1] if lines else "", row.answer)


async def _agents(env: EnvConfig, chunk: AgentRuns) -> list[float]:
    runs = (_agent(env, r, e, chunk.base_url) for r, e in zip(chunk.rows, chunk.episode_ids, strict=True))
    return list(await asyncio.gather(*runs))


def run_agents(env: EnvConfig, chunk: AgentRuns) -> list[float]:
    """An agent task: run the agent program once per row of `chunk`, side by side; the reward of each run (its
    last printed line against the row's answer). A run that fails, or outlives env.agent_timeout_s, fails the
    chunk with an EnvError naming the prompt (and the end of its stderr)."""
    return asyncio.run(_agents(env, chunk))


# Threads asyncio.to_thread has at least (its default executor: min(32, CPUs + 4)): a chunk's sandboxed episodes run
# this many at once or more, on any worker.
EPISODE_THREADS_AT_LEAST = 5


def chunk_time_limit(env: EnvConfig, episodes: int) -> float:
    """The longest a healthy worker may take on a chunk of `episodes` single-turn episodes because of the env's own
    time limits (0 for an env without any): code runs each completion's tests for up to env.sandbox.timeout_s,
    several at once (EPISODE_THREADS_AT_LEAST), with half that again for starting and reaping the sandbox; agents
    all run at once, each for up to env.agent_timeout_s. The pool's time limit for a chunk is this plus
    runtime.env_task_timeout_s, so that completions that all loop until the sandbox kills them are not taken for a
    hung worker."""
    if env.agent_program:
        return env.agent_timeout_s
    if env.name == "code":
        return math.ceil(episodes / EPISODE_THREADS_AT_LEAST) * env.sandbox.timeout_s * 1.5
    return 0.0


def run_task(
    env: EnvConfig | str, task: Chunk | Histories | AgentRuns
) -> list[Verdict] | list[StepResult] | list[float]:
    """An env worker's task, of any kind: a Histories is stepped, an AgentRuns run, a (texts, rows) chunk scored."""
    if isinstance(task, AgentRuns):
        return run_agents(EnvConfig(name=env) if isinstance(env, str) else env, task)
    return step_chunk(env, task) if isinstance(task, Histories) else score_chunk(env, task)
