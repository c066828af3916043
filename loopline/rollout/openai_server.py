"""An OpenAI-compatible endpoint in front of an engine, recording what it serves.

An agent program written against the OpenAI API (any client with a `base_url`) can be trained:
point it at `server.base_url`, tag its requests with a trajectory id (`X-Trajectory-Id` header or
the `user` field), and read `server.trajectories()`: for every completion served, the prompt token
ids, the completion token ids and their log-probs, exactly as sampled. `to_trajectories` turns one
trajectory's calls into training sequences, joining a call to the previous one when its prompt
continues it token for token (else it starts a new sequence: nothing is ever re-tokenized).

Endpoints: `POST /v1/chat/completions` (messages, temperature, top_p, max_tokens, n, stop, seed,
logprobs, tools, user, stream, stream_options), `POST /v1/completions` (prompt as a string or as
token ids; the same sampling fields, logprobs as a count, stream) and `GET /v1/models`. The chat
prompt is the tokenizer's chat template when it has one, else a built-in role format
(`builtin_chat_format`). With `tools` in the request, tool calls in the text (rollout.tool_calls
tags) come back as `message.tool_calls`. Any `model` name is accepted (agent programs hard-code
theirs); responses name `cfg.model_name`.

Streaming (`stream: true`) answers Server-Sent Events in OpenAI's chunk format, ending with
`data: [DONE]`. Simplified: the engine's `generate` returns whole completions, so a turn is
generated first and then sent as chunks cut at token boundaries (a character split over tokens is
never cut); the recorded tokens and log-probs are the same as without streaming.

The server is aiohttp on its own thread and event loop. Engine calls never run on the loop: one
engine thread owns the engine and generates, in one call, every pending request that samples with
the same settings (waiting `batch_wait_s` for more to arrive; rollout.engine_queue); handlers await
its answer. The request fields and response pieces are in rollout.openai_wire. Binds 127.0.0.1 and
a free port by default.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web
from pydantic import Field
from transformers import PreTrainedTokenizerBase

from loopline.data.datasets import PromptRow
from loopline.rollout.engine import Completion, SamplingParams, TorchEngine
from loopline.rollout.engine_queue import EngineQueue, ServerClosed
from loopline.rollout.openai_wire import (
    Choice,
    RequestError,
    body_bool,
    body_float,
    body_int,
    builtin_chat_format,
    decode_ids,
    error_response,
    json_body,
    message_of,
    parse_messages,
    sse_response,
    stream_flags,
    strip_stop,
    text_deltas,
    text_offsets,
    then,
    usage_of,
)
from loopline.rollout.tool_calls import MalformedCall, ToolsConfig, parse_tool_calls
from loopline.rollout.trajectory import Trajectory
from loopline.section import Section

logger = logging.getLogger(__name__)


class ServerConfig(Section):
    """The OpenAI-compatible server."""

    host: str = Field("127.0.0.1", description="Address to bind (loopback by default).")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 = a free one (read server.port).")
    model_name: str = Field("loopline", description="Model id reported by /v1/models and in responses.")
    default_max_tokens: int = Field(
        256, gt=0, description="max_tokens when a request gives none (cut to the room left in the context)."
    )
    max_tokens_limit: int = Field(2048, gt=0, description="Largest max_tokens accepted.")
    max_n: int = Field(16, gt=0, description="Largest n (completions per request) accepted.")
    batch_wait_s: float = Field(0.01, ge=0, description="How long a batch waits for more requests to join.")
    max_batch: int = Field(64, gt=0, description="Most sequences generated in one engine call.")
    request_timeout_s: float = Field(600.0, gt=0, description="A request waiting longer is answered 503.")
    trajectory_header: str = Field("X-Trajectory-Id", description="Header naming the request's trajectory.")
    trajectory_from_api_key: bool = Field(
        False,
        description="Without the header or `user`, the request's API key (Authorization: Bearer ...) names its "
        "trajectory: an unmodified agent given OPENAI_API_KEY=<episode id> tags every call it makes.",
    )
    max_body_bytes: int = Field(64 << 20, gt=0, description="Largest request body accepted (413 above).")
    backlog: int = Field(1024, gt=0, description="Connections the socket queues before accepting them.")


@dataclass(frozen=True)
class ServedCompletion:
    """One completion the server returned, with the tokens behind it."""

    trajectory_id: str
    request_id: str
    choice: int  # index among the request's n choices
    prompt_ids: list[int]
    completion_ids: list[int]  # as sampled, including a stop string or EOS that ended it
    logprobs: list[float]  # engine log-prob of each completion token
    content: str  # the text returned (a trailing stop string removed, as OpenAI does)
    finish_reason: str
    policy_version: int


class OpenAIServer:
    """Serves the OpenAI API from `engine` on a background thread; use as a context manager."""

    def __init__(
        self, engine: TorchEngine, tokenizer: PreTrainedTokenizerBase, cfg: ServerConfig | None = None
    ) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg or ServerConfig()
        self.tools_cfg = ToolsConfig()
        self._records: dict[str, list[ServedCompletion]] = {}
        self._records_lock = threading.Lock()
        self._engine_queue = EngineQueue(engine, self.cfg.max_batch, self.cfg.batch_wait_s)
        model_cfg = getattr(getattr(engine, "model", None), "config", None)
        self._context: int | None = getattr(model_cfg, "max_position_embeddings", None)
        # bound now, so that the port is known before start (as with port 0 it is chosen here)
        family = socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET
        self._sock = socket.create_server((self.cfg.host, self.cfg.port), family=family)
        self._port = int(self._sock.getsockname()[1])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._http = threading.Thread(target=self._serve, name="openai-http", daemon=True)

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> OpenAIServer:
        """Start serving; returns self once the server accepts requests."""
        self._http.start()
        self._engine_queue.start()
        if not self._ready.wait(60) or self._startup_error is not None:
            self.close()
            raise RuntimeError(f"the server did not start: {self._startup_error!r}")
        return self

    def close(self) -> None:
        """Stop the engine thread (queued requests are answered 503), then the HTTP server."""
        self._engine_queue.close()
        if self._loop is not None and self._http.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._http.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def batch_sizes(self) -> list[int]:
        """Sequences per engine call, for metrics and tests."""
        return self._engine_queue.batch_sizes

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as base_url."""
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.port}/v1"

    # -- what was served --------------------------------------------------------------------

    def trajectories(self) -> dict[str, list[ServedCompletion]]:
        """Every completion served so far, by trajectory id, in the order served."""
        with self._records_lock:
            return {k: list(v) for k, v in self._records.items()}

    def pop_trajectories(self) -> dict[str, list[ServedCompletion]]:
        """`trajectories()`, then forget them (e.g. once per training step)."""
        with self._records_lock:
            out, self._records = self._records, {}
        return out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights for the engine, between two generate calls."""
        self._engine_queue.update_weights(state_dict, version)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        """The chat template's rendering of the messages (with a generation prompt), else the built-in one."""
        if getattr(self.tokenizer, "chat_template", None):
            from jinja2 import TemplateError  # what transformers renders templates with

            try:
                ids = self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            except TemplateError as e:  # e.g. a template that wants roles to alternate
                raise RequestError(f"the chat template refused the messages: {e}") from None
            return list(ids)
        text = builtin_chat_format(messages, self.tokenizer.eos_token or "")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ======================================================================================
    # The endpoints (on the event loop)
    # ======================================================================================

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        messages = parse_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list")
        logprobs = body_bool(body, "logprobs")
        stream, include_usage = stream_flags(body)
        requested = body_int(body, "max_tokens", 0, 1, self.cfg.max_tokens_limit)  # 0: not given
        requested = body_int(body, "max_completion_tokens", requested, 1, self.cfg.max_tokens_limit)
        prompt = self.prompt_ids(messages, tools)
        params, n = self._sampling(body, self._max_tokens(prompt, requested))
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        trajectory_id = self._trajectory_id(request, body, request_id)
        completions = await self._generate(prompt, params, n)

        choices = [self._choice(c, params.stop, bool(tools)) for c in completions]
        self._record(trajectory_id, request_id, prompt, choices)
        head = {"id": request_id, "created": int(time.time()), "model": self.cfg.model_name}
        head["system_fingerprint"] = f"policy-v{completions[0].policy_version}"
        usage = usage_of(prompt, completions)
        if stream:
            events = self._chat_chunks(head, choices, logprobs)
            if include_usage:
                events = then(
                    events, {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                )
            return await sse_response(request, events)
        answer = [
            {
                "index": i,
                "message": message_of(ch),
                "finish_reason": ch.finish_reason,
                "logprobs": {"content": self._logprobs(ch.completion.token_ids, ch.completion.logprobs)}
                if logprobs
                else None,
            }
            for i, ch in enumerate(choices)
        ]
        return web.json_response({**head, "object": "chat.completion", "choices": answer, "usage": usage})

    def _chat_chunks(
        self, head: dict[str, Any], choices: list[Choice], logprobs: bool
    ) -> Iterator[dict[str, Any]]:
        """Per choice: the role, the text in pieces, the tool calls, then the finish reason."""

        def chunk(i: int, delta: dict[str, Any], ids: range, finish: str | None = None) -> dict[str, Any]:
            c = choices[i].completion
            lp = None
            if logprobs:
                lp = {"content": self._logprobs([c.token_ids[j] for j in ids], [c.logprobs[j] for j in ids])}
            event = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {**head, "object": "chat.completion.chunk", "choices": [event]}

        for i, ch in enumerate(choices):
            yield chunk(i, {"role": "assistant", "content": ""}, range(0))
            sent = 0  # tokens covered by the chunks so far
            for piece, upto in text_deltas(self.tokenizer, ch.completion.token_ids, ch.shown or ""):
                yield chunk(i, {"content": piece}, range(sent, upto))
                sent = upto
            if ch.tool_calls:
                calls = [{"index": j, **call} for j, call in enumerate(ch.tool_calls)]
                yield chunk(i, {"tool_calls": calls}, range(0))
            yield chunk(i, {}, range(sent, len(ch.completion.token_ids)), ch.finish_reason)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        prompt = self._prompt(body.get("prompt"))
        count = body_int(body, "logprobs", -1, 0, 5)  # the legacy API's count of alternatives (none are sent)
        stream, include_usage = stream_flags(body)
        if body_bool(body, "echo"):
            raise RequestError("'echo' is not supported")
        if body.get("suffix") is not None:
            raise RequestError("'suffix' is not supported")
        requested = body_int(body, "max_tokens", 0, 1, self.cfg.max_tokens_limit)  # 0: not given
        params, n = self._sampling(body, self._max_tokens(prompt, requested))
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        trajectory_id = self._trajectory_id(request, body, request_id)
        completions = await self._generate(prompt, params, n)

        choices = [self._choice(c, params.stop, False) for c in completions]
        self._record(trajectory_id, request_id, prompt, choices)
        head = {"id": request_id, "object": "text_completion", "created": int(time.time())}
        head["model"] = self.cfg.model_name
        head["system_fingerprint"] = f"policy-v{completions[0].policy_version}"
        usage = usage_of(prompt, completions)
        if stream:
            events = self._completion_chunks(head, choices, count >= 0)
            if include_usage:
                events = then(events, {**head, "choices": [], "usage": usage})
            return await sse_response(request, events)
        answer = [
            {
                "index": i,
                "text": ch.content,
                "finish_reason": ch.finish_reason,
                "logprobs": self._legacy_logprobs(
                    ch.completion,
                    range(len(ch.completion.token_ids)),
                    text_offsets(self.tokenizer, ch.completion),
                )
                if count >= 0
                else None,
            }
            for i, ch in enumerate(choices)
        ]
        return web.json_response({**head, "choices": answer, "usage": usage})

    def _completion_chunks(
        self, head: dict[str, Any], choices: list[Choice], logprobs: bool
    ) -> Iterator[dict[str, Any]]:
        """Per choice: the text in pieces, then the finish reason."""

        def chunk(i: int, text: str, ids: range, finish: str | None = None) -> dict[str, Any]:
            lp = self._legacy_logprobs(choices[i].completion, ids, offsets) if logprobs else None
            return {**head, "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]}

        for i, ch in enumerate(choices):
            offsets = text_offsets(self.tokenizer, ch.completion) if logprobs else []
            sent = 0
            for piece, upto in text_deltas(self.tokenizer, ch.completion.token_ids, ch.content):
                yield chunk(i, piece, range(sent, upto))
                sent = upto
            yield chunk(i, "", range(sent, len(ch.completion.token_ids)), ch.finish_reason)

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "loopline"}
        return web.json_response({"object": "list", "data": [model]})

    # -- shared by the endpoints -----------------------------------------------------------

    def _sampling(self, body: dict[str, Any], max_tokens: int) -> tuple[SamplingParams, int]:
        """The sampling fields both endpoints take, checked; and n."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError("'model' must be a string")
        n = body_int(body, "n", 1, 1, self.cfg.max_n)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise RequestError("'stop' must be a string or a list of at most 4 non-empty strings")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError("'seed' must be an integer")
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=body_float(body, "temperature", 1.0, 0.0, 2.0),
            top_p=body_float(body, "top_p", 1.0, 1e-6, 1.0),
            stop=tuple(stop),
            seed=seed,
        )
        return params, n

    def _prompt(self, raw: Any) -> list[int]:
        """The completions endpoint's prompt: a string (tokenized as the tokenizer does by default,
        special tokens included) or token ids; a list holding one of those is taken as that one."""
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
            raw = raw[0]
        if isinstance(raw, str):
            ids = list(self.tokenizer(raw)["input_ids"])
        elif (
            isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)
        ):
            ids = raw
            if not all(0 <= t < len(self.tokenizer) for t in ids):
                raise RequestError(f"'prompt' token ids must be in [0, {len(self.tokenizer)})")
        else:
            raise RequestError(
                "'prompt' must be a string or a non-empty list of token ids (one prompt per request)"
            )
        if not ids:
            raise RequestError("'prompt' is empty once tokenized")
        return ids

    def _max_tokens(self, prompt: list[int], requested: int) -> int:
        """`requested` (0: not given, then the default, cut to what the model's context leaves)."""
        if self._context is None:
            return requested or self.cfg.default_max_tokens
        room = self._context - len(prompt)
        if room < 1:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) leaves no room in the model's context ({self._context} tokens)"
            )
        if requested > room:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({requested}) is longer than the "
                f"model's context ({self._context} tokens)"
            )
        return requested or min(self.cfg.default_max_tokens, room)

    async def _generate(self, prompt: list[int], params: SamplingParams, n: int) -> list[Completion]:
        """The engine thread's completions of `prompt`; the event loop stays free while it works."""
        future = self._engine_queue.submit(prompt, params, n)
        # a timeout cancels the wrapped future, which cancels the pending one if it is not yet generating
        return await asyncio.wait_for(asyncio.wrap_future(future), self.cfg.request_timeout_s)

    def _trajectory_id(self, request: web.Request, body: dict[str, Any], request_id: str) -> str:
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise RequestError("'user' must be a string")
        named = request.headers.get(self.cfg.trajectory_header) or user
        if not named and self.cfg.trajectory_from_api_key:
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            named = key.strip() if scheme.lower() == "bearer" else ""
        return named or request_id

    def _choice(self, c: Completion, stop: Sequence[str], tools: bool) -> Choice:
        content = strip_stop(c.text, stop) if c.finish_reason == "stop" else c.text
        calls = self._tool_calls(content) if tools else []
        if calls:
            shown = content[: content.find(self.tools_cfg.call_open)] or None
            return Choice(c, content, shown, calls, "tool_calls")
        return Choice(c, content, content, [], c.finish_reason)

    def _record(self, trajectory_id: str, request_id: str, prompt: list[int], choices: list[Choice]) -> None:
        records = [
            ServedCompletion(
                trajectory_id,
                request_id,
                i,
                prompt,
                list(ch.completion.token_ids),
                list(ch.completion.logprobs),
                ch.content,
                ch.completion.finish_reason,
                ch.completion.policy_version,
            )  # fmt: skip
            for i, ch in enumerate(choices)
        ]
        with self._records_lock:
            self._records.setdefault(trajectory_id, []).extend(records)

    def _tool_calls(self, content: str) -> list[dict[str, Any]]:
        calls = []
        for call in parse_tool_calls(content, self.tools_cfg):
            if isinstance(call, MalformedCall):
                continue  # stays in the content for the agent program to see
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:16]}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
            )
        return calls

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> list[dict[str, Any]]:
        out = []
        for tok, lp in zip(token_ids, logprobs):
            text = decode_ids(self.tokenizer, [tok], skip_special=False)
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return out

    def _legacy_logprobs(self, c: Completion, ids: range, offsets: list[int]) -> dict[str, Any]:
        """The completions API's logprobs object for tokens `ids` of `c` (no alternatives: top_logprobs None);
        `offsets`: `text_offsets` of all of c's tokens."""
        return {
            "tokens": [decode_ids(self.tokenizer, [c.token_ids[j]], skip_special=False) for j in ids],
            "token_logprobs": [c.logprobs[j] for j in ids],
            "top_logprobs": None,
            "text_offset": [offsets[j] for j in ids],
        }

    # ======================================================================================
    # Plumbing: the HTTP thread and the engine thread
    # ======================================================================================

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.cfg.max_body_bytes)
        for path in ("/v1/chat/completions", "/chat/completions"):
            app.router.add_post(path, self._chat)
            app.router.add_post(path + "/", self._chat)
        for path in ("/v1/completions", "/completions"):
            app.router.add_post(path, self._completions)
            app.router.add_post(path + "/", self._completions)
        for path in ("/v1/models", "/models"):
            app.router.add_get(path, self._models)
            app.router.add_get(path + "/", self._models)
        return app

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every failure as an OpenAI error object with a status: the client is told, the server keeps serving."""
        try:
            return await handler(request)
        except RequestError as e:
            return error_response(400, str(e), "invalid_request_error")
        except web.HTTPException as e:  # aiohttp's own: no route, wrong method, body too large
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            what = f"no route {request.method} {request.path}" if e.status == 404 else e.reason
            if e.status == 405:
                what = f"{request.method} is not allowed on {request.path}"
            return error_response(e.status, what, kind)
        except TimeoutError:
            return error_response(503, "the engine did not answer in time", "server_error")
        except ServerClosed as e:
            return error_response(503, str(e), "server_error")
        except Exception as e:  # noqa: BLE001 - a failed generate fails its request, not the server
            logger.exception("request %s %s failed", request.method, request.path)
            return error_response(500, f"{type(e).__name__}: {e}", "server_error")

    def _serve(self) -> None:
        """The HTTP thread: the aiohttp app on this thread's own event loop, until close() stops it."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=5.0)
        try:
            loop.run_until_complete(runner.setup())
            site = web.SockSite(runner, self._sock, backlog=self.cfg.backlog)
            loop.run_until_complete(site.start())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._startup_error = e
            self._ready.set()
            loop.close()
            return
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()


def to_trajectories(calls: Sequence[ServedCompletion]) -> list[Trajectory]:
    """One trajectory's calls as training sequences (prompt masked, completions trained).

    A call whose prompt starts with the previous sequence (its prompt and tokens so far) continues
    it: the new prompt tokens are appended with mask 0, the completion with mask 1. Any other call
    starts a new sequence. Rewards are left to the caller (`Trajectory.rewards`).
    """
    out: list[Trajectory] = []
    for call in calls:
        current = out[-1] if out else None
        if current is not None:
            prefix = current.prompt_ids + current.tokens
            if call.prompt_ids[: len(prefix)] == prefix and len(call.prompt_ids) >= len(prefix):
                current.add_observation(call.prompt_ids[len(prefix) :])
                current.add_model_turn(call.completion_ids, call.logprobs)
                current.policy_version = min(current.policy_version, call.policy_version)
                continue
        traj = Trajectory(PromptRow(len(out), call.trajectory_id), list(call.prompt_ids))
        traj.add_model_turn(call.completion_ids, call.logprobs)
        traj.policy_version = call.policy_version
        out.append(traj)
    return out
