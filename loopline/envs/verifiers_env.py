"""verifiers environments in loopline's loop: env.name=verifiers:MODULE_OR_FILE[:NAME].

NAME (default `load_environment`, the verifiers convention) is a vf.Environment or a function that returns one,
called with no arguments, once per process (the controller reads its dataset; each env worker steps it). What maps
onto loopline's episodes:
- rows: with data.source=builtin (the default), the env's dataset is the training split and its eval_dataset the
  held-out one (none: the training rows, as verifiers' own evaluation falls back). A row's prompt messages (system
  prompt, few-shot, user) are joined into one text prompt, after a paragraph listing the env's tools if it has any;
  the row carries the verifiers input whole (`verifiers_input`), so each worker rebuilds exactly that input. A file
  dataset works too: its prompt (or messages), answer and extra fields (as `info`) become the input.
- turns: the env's own rollout protocol runs as it is written (setup_state, env_response after each model turn,
  its stop conditions, final_env_response, cleanup), driven by a client that answers each model call with the
  text loopline's engine sampled for that turn: loopline generates (tokens in, tokens out), verifiers never calls a
  model. Tool calls are read from the text (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  rollout.tool_calls) into the message's tool_calls; the messages env_response adds are the next observation (a
  tool's result between `<tool_result>` tags).
- reward: the env's rubric scores the finished rollout (weighted sum of its reward functions, as verifiers
  computes it), paid on the last turn; each reward function's and metric's value is in the episode's info as
  `vf_<name>`, and `correct` is reward >= the env's pass_threshold (verifiers' pass@k rule). A vf.Error the
  rollout met (a tool's, with stop_errors) ends it as verifiers does, scored, with `vf_error` 1; any other
  exception fails the episode (EnvError naming the prompt).
Not mapped: group reward functions (a rubric that scores a group together), a rubric's own advantages, and the
env's sampling_args (loopline's sampling config decides). An episode loopline cuts (env.max_turns,
env.max_episode_tokens) before the env's stop conditions end it is not scored: reward 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from loopline.data.rows import PromptRow
from loopline.envs.base import StepResult
from loopline.envs.config import EnvConfig
from loopline.envs.episodes import EnvError, EnvFactory
from loopline.envs.library import named, require
from loopline.envs.tools import tools_paragraph
from loopline.rollout.tool_calls import MalformedCall, ToolsConfig, parse_tool_calls

INPUT_FIELD = "verifiers_input"  # the row's extra field holding the verifiers input (JSON)
TOOLS = ToolsConfig()  # how calls are written in the text and results shown (loopline's tool envs' tags)
_LIVE: set[asyncio.Future] = set()  # the rollouts under way in this process


# ---------------------------------------------------------------------------------------------
# The environment, once per process
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _own_signals() -> Iterator[None]:
    """A vf.Environment sets SIGINT and SIGTERM handlers as it is made (its teardown, then exit): the process keeps
    its own (an env worker ignores SIGINT: the run's process handles Ctrl-C and stops the workers)."""
    if (
        threading.current_thread() is not threading.main_thread()
    ):  # only the main thread may set them: none set
        real = signal.signal
        signal.signal = lambda *args: None  # type: ignore[assignment]
        try:
            yield
        finally:
            signal.signal = real
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


@functools.cache
def environment(name: str) -> Any:  # -> verifiers Environment
    """The vf.Environment that env.name=`name` names, made once per process."""
    vf = require(name, "verifiers")
    attr, obj = named(name, "load_environment")
    if not isinstance(obj, vf.Environment):
        if not callable(obj):
            raise EnvError(
                f"env.name={name}: {attr} is neither a vf.Environment nor a function returning one"
            )
        datasets = require(name, "datasets")
        quiet = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # the dataset's map() bars, once per worker
        try:
            with _own_signals():
                obj = obj()
        except Exception as e:
            raise EnvError(f"env.name={name}: {attr}() raised {type(e).__name__}: {e}") from e
        finally:
            if quiet:
                datasets.enable_progress_bars()
        if not isinstance(obj, vf.Environment):
            raise EnvError(f"env.name={name}: {attr}() returned {type(obj).__name__}, not a vf.Environment")
    if obj.rubric.has_group_rewards:
        raise EnvError(
            f"env.name={name}: its rubric has group reward functions (scored over a group of rollouts at once), "
            "which loopline does not run: each episode is scored on its own"
        )
    return obj


def verifiers_env(env: EnvConfig) -> EnvFactory:
    """env.name=verifiers:...: a fresh episode of the named vf.Environment per call."""
    return functools.partial(VerifiersEpisode, environment(env.name), env.name)


def verifiers_rows(env: EnvConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow], list[PromptRow]]:
    """data.source=builtin: the env's dataset (train), its eval_dataset (held out; none: the train rows), no
    validation split."""
    vf_env = environment(env.name)
    train = _rows(vf_env, vf_env.get_dataset())
    has_eval = vf_env.eval_dataset is not None or vf_env.eval_dataset_source is not None
    return train, _rows(vf_env, vf_env.get_eval_dataset()) if has_eval else train, []


def _rows(vf_env: Any, dataset: Any) -> list[PromptRow]:
    rows = []
    for i, record in enumerate(dataset):
        record = dict(record)
        prompt = prompt_text(record["prompt"], vf_env.tool_defs)
        extra = ((INPUT_FIELD, json.dumps(record, default=str)),)
        rows.append(PromptRow(i, prompt, answer=str(record.get("answer") or ""), extra=extra))
    return rows


def _input(row: PromptRow) -> dict[str, Any]:
    """The verifiers input (RolloutInput) of a row: its own when the env's dataset made it, else from its fields."""
    if held := row.get(INPUT_FIELD):
        return json.loads(held)
    messages = list(row.messages) or [{"role": "user", "content": row.prompt}]
    info = {k: v for k, v in row.extra}
    return {"prompt": messages, "answer": row.answer, "example_id": row.index, "info": info}


# ---------------------------------------------------------------------------------------------
# Messages <-> text
# ---------------------------------------------------------------------------------------------


def _field(message: Any, key: str) -> Any:
    return message.get(key) if isinstance(message, dict) else getattr(message, key, None)


def _content(message: Any) -> str:
    content = _field(message, "content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(_field(part, "text") or "") for part in content)  # content parts: the text ones


def prompt_text(messages: Sequence[Any], tool_defs: Sequence[Any] | None) -> str:
    """A prompt's messages as one text: the tools paragraph (envs.tools) when the env has tools, then each
    message's content, separated by blank lines."""
    parts = [_content(m) for m in messages]
    if tool_defs:
        functions = [_tool_function(t) for t in tool_defs]
        parts.insert(0, tools_paragraph(functions, TOOLS))
    return "\n\n".join(p for p in parts if p)


def _tool_function(tool: Any) -> dict[str, Any]:
    return {k: _field(tool, k) for k in ("name", "description", "parameters")}


def observation_text(messages: Sequence[Any]) -> str:
    """What the env answered after the model's last turn (the messages after the last assistant one): a tool's
    result between the result tags, any other message's content; one per line."""
    last = max((i for i, m in enumerate(messages) if _field(m, "role") == "assistant"), default=-1)
    parts = []
    for m in messages[last + 1 :]:
        text = _content(m)
        parts.append(TOOLS.result_open + text + TOOLS.result_close if _field(m, "role") == "tool" else text)
    return "\n".join(parts)


def _response(text: str, turn: int) -> Any:  # -> verifiers Response
    """The model's turn as a verifiers Response: the text, its tool calls (a malformed one keeps its raw text as
    arguments, so the env answers with its own parse error) apart."""
    from verifiers.legacy.types import Response, ResponseMessage, ToolCall

    calls = []
    for k, call in enumerate(parse_tool_calls(text, TOOLS)):
        if isinstance(call, MalformedCall):
            calls.append(ToolCall(id=f"call_{turn}_{k}", name="", arguments=call.raw))
        else:
            calls.append(
                ToolCall(id=f"call_{turn}_{k}", name=call.name, arguments=json.dumps(call.arguments))
            )
    content = text.split(TOOLS.call_open, 1)[0].strip() if calls else text
    message = ResponseMessage(
        content=content,
        tool_calls=calls or None,
        finish_reason="tool_calls" if calls else "stop",
        is_truncated=False,
    )
    return Response(id=f"loopline-{turn}", created=0, model="loopline", message=message)


@functools.cache
def _played_client() -> type:
    """A verifiers Client that answers each model call with the episode's next action (made on first use: the
    library is imported only when a verifiers env is named)."""
    from verifiers.legacy.clients import Client

    class PlayedClient(Client):
        def __init__(self, episode: VerifiersEpisode) -> None:
            super().__init__(None)
            self.episode = episode

        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the played client answers in get_response")

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

        async def get_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> Any:
            return await self.episode.model_turn(prompt, tools)

    return PlayedClient


# ---------------------------------------------------------------------------------------------
# One episode as an envs.base.Env
# ---------------------------------------------------------------------------------------------


class VerifiersEpisode:
    """One rollout of a vf.Environment as an envs.base.Env: reset starts the env's rollout, which waits at each model
    call for the action that step brings; step answers with what the env said next, or the rubric's score."""

    def __init__(self, env: Any, name: str) -> None:
        self.env, self.name = env, name
        self._turns = 0

    async def reset(self, sample: PromptRow) -> str:
        """Start the env's rollout on the row's input; the first observation is its prompt, as text."""
        self._actions: asyncio.Queue[str] = asyncio.Queue()
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        task = asyncio.ensure_future(self._play(_input(sample)))
        # held until it ends: an episode replayed only part way is dropped mid-rollout, and its rollout is then
        # cancelled with the event loop (asyncio.run), its cleanup run, instead of being collected while pending
        _LIVE.add(task)
        task.add_done_callback(_LIVE.discard)
        kind, payload = await self._events.get()
        if kind == "raise":
            raise payload
        if kind == "done":
            raise RuntimeError(f"the rollout ended before the model's first turn ({payload.get('error')})")
        return payload

    async def step(self, action: str) -> StepResult:
        """Hand the env the model's turn; its next observation, or (done) the rubric's reward."""
        self._actions.put_nowait(action)
        kind, payload = await self._events.get()
        if kind == "raise":
            raise payload
        if kind == "ask":
            return StepResult(payload, 0.0, False)
        reward = float(payload.get("reward") or 0.0)
        info: dict[str, float | int | str] = {
            f"vf_{k}": float(v)
            for k, v in (payload.get("metrics") or {}).items()
            if isinstance(v, int | float)
        }
        info["correct"] = float(reward >= self.env.pass_threshold)
        if payload.get("error"):
            info["vf_error"] = 1
        return StepResult("", reward, True, info)

    async def model_turn(self, prompt: Any, tools: Any) -> Any:
        """The env's rollout asks for the model's turn: show it what the env said, wait for the action."""
        first = self._turns == 0
        self._events.put_nowait(("ask", prompt_text(prompt, tools) if first else observation_text(prompt)))
        action = await self._actions.get()
        self._turns += 1
        return _response(action, self._turns)

    async def _play(self, rollout_input: dict[str, Any]) -> None:
        try:
            output = await self.env.run_rollout(rollout_input, _played_client()(self), "loopline", {})
        except Exception as e:
            self._events.put_nowait(("raise", e))
            return
        self._events.put_nowait(("done", output))
