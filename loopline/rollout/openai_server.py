"""An OpenAI-compatible chat-completions endpoint in front of an engine, recording what it serves.

An agent program written against the OpenAI API (any client with a `base_url`) can be trained:
point it at `server.base_url`, tag its requests with a trajectory id (`X-Trajectory-Id` header or
the `user` field), and read `server.trajectories()`: for every completion served, the prompt token
ids, the completion token ids and their log-probs, exactly as sampled. `to_trajectories` turns one
trajectory's calls into training sequences, joining a call to the previous one when its prompt
continues it token for token (else it starts a new sequence: nothing is ever re-tokenized).

Endpoints: `POST /v1/chat/completions` (messages, temperature, top_p, max_tokens, n, stop, seed,
logprobs, tools, user) and `GET /v1/models`. The prompt is the tokenizer's chat template when it has
one, else a built-in role format (`builtin_chat_format`). With `tools` in the request, tool calls in
the text (rollout.tool_calls tags) come back as `message.tool_calls`.

Concurrent requests are batched: one thread owns the engine and generates, in one call, every
pending request that samples with the same settings (waiting `batch_wait_s` for more to arrive).
Standard library only (http.server); binds 127.0.0.1 and a free port by default.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from pydantic import Field
from transformers import PreTrainedTokenizerBase

from loopline.data.datasets import PromptRow
from loopline.rollout.engine import Completion, SamplingParams, TorchEngine
from loopline.rollout.tool_calls import MalformedCall, ToolsConfig, parse_tool_calls
from loopline.rollout.trajectory import Trajectory
from loopline.section import Section

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


class ServerConfig(Section):
    """The chat-completions server."""

    host: str = Field("127.0.0.1", description="Address to bind (loopback by default).")
    port: int = Field(0, ge=0, le=65535, description="Port; 0 = a free one (read server.port).")
    model_name: str = Field("loopline", description="Model id reported by /v1/models and in responses.")
    default_max_tokens: int = Field(256, gt=0, description="max_tokens when a request gives none.")
    max_tokens_limit: int = Field(2048, gt=0, description="Largest max_tokens accepted.")
    max_n: int = Field(16, gt=0, description="Largest n (completions per request) accepted.")
    batch_wait_s: float = Field(0.01, ge=0, description="How long a batch waits for more requests to join.")
    max_batch: int = Field(64, gt=0, description="Most sequences generated in one engine call.")
    request_timeout_s: float = Field(600.0, gt=0, description="A request waiting longer is answered 503.")
    trajectory_header: str = Field("X-Trajectory-Id", description="Header naming the request's trajectory.")


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


class RequestError(ValueError):
    """A request the server refuses; the message goes back to the client with status 400."""


def builtin_chat_format(messages: Sequence[Mapping[str, Any]], eos: str) -> str:
    """`<|role|>` header, newline, content, EOS per message; then `<|assistant|>` and a newline.

    A message is closed by the EOS text so that an assistant turn the model ended with EOS renders
    back to the very tokens it sampled (for byte-level tokenizers), and the next call continues it.
    """
    parts = [f"<|{m['role']}|>\n{_text(m)}{eos}" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:  # a list of parts: the text ones are kept
        text = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    tags = ToolsConfig()
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise RequestError("a tool call must be {'type': 'function', 'function': {'name', 'arguments'}}")
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = fn.get("arguments")  # shown as sent
        # compact JSON, as the model writes calls: the message renders back to the tokens it sampled
        body = json.dumps({"name": fn.get("name"), "arguments": arguments}, separators=(",", ":"))
        text += tags.call_open + body + tags.call_close
    return text


@dataclass
class _Pending:
    """A request waiting for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    future: Future[list[Completion]]


class OpenAIServer:
    """Serves chat completions from `engine` on a background thread; use as a context manager."""

    def __init__(
        self, engine: TorchEngine, tokenizer: PreTrainedTokenizerBase, cfg: ServerConfig | None = None
    ) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg or ServerConfig()
        self.tools_cfg = ToolsConfig()
        self._records: dict[str, list[ServedCompletion]] = {}
        self._records_lock = threading.Lock()
        self._engine_lock = threading.Lock()  # generate and update_weights never overlap
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._stop = threading.Event()
        self._httpd = ThreadingHTTPServer((self.cfg.host, self.cfg.port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._threads = [
            threading.Thread(target=self._httpd.serve_forever, name="openai-http", daemon=True),
            threading.Thread(target=self._generate_loop, name="openai-engine", daemon=True),
        ]
        self.batch_sizes: list[int] = []  # sequences per engine call, for metrics and tests

    # -- lifetime ---------------------------------------------------------------------------

    def start(self) -> OpenAIServer:
        """Start serving; returns self."""
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        """Stop serving and the engine thread."""
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(timeout=10)

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as base_url."""
        return f"http://{self.cfg.host}:{self.port}/v1"

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
        with self._engine_lock:
            self.engine.update_weights(state_dict, version)

    # -- requests ---------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The chat template's rendering of the messages (with a generation prompt), else the built-in one."""
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return list(ids)
        text = builtin_chat_format(messages, self.tokenizer.eos_token or "")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def complete(self, body: dict[str, Any], trajectory_id: str) -> dict[str, Any]:
        """Answer one chat-completions request body (raises RequestError when it is invalid)."""
        messages = _messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list")
        n = _int(body, "n", 1, 1, self.cfg.max_n)
        max_tokens = _int(
            body, "max_completion_tokens", _int(body, "max_tokens", self.cfg.default_max_tokens, 1, self.cfg.max_tokens_limit),
            1, self.cfg.max_tokens_limit,
        )  # fmt: skip
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise RequestError("'stop' must be a string or a list of at most 4 non-empty strings")
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise RequestError("'seed' must be an integer")
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_float(body, "top_p", 1.0, 1e-6, 1.0),
            stop=tuple(stop),
            seed=seed,
        )
        prompt = self.prompt_ids(messages, tools)
        pending = _Pending(prompt, params, n, Future())
        self._queue.put(pending)
        try:
            completions = pending.future.result(timeout=self.cfg.request_timeout_s)
        except TimeoutError:
            pending.future.cancel()
            raise
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        trajectory_id = trajectory_id or str(body.get("user") or "") or request_id
        choices, records = [], []
        for i, c in enumerate(completions):
            content = _strip_stop(c.text, stop) if c.finish_reason == "stop" else c.text
            message: dict[str, Any] = {"role": "assistant", "content": content}
            finish = c.finish_reason
            if tools:
                calls = self._tool_calls(content)
                if calls:
                    message["content"] = content[: content.find(self.tools_cfg.call_open)] or None
                    message["tool_calls"] = calls
                    finish = "tool_calls"
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
            }
            if body.get("logprobs"):
                choice["logprobs"] = {"content": self._token_logprobs(c)}
            choices.append(choice)
            records.append(
                ServedCompletion(
                    trajectory_id,
                    request_id,
                    i,
                    prompt,
                    list(c.token_ids),
                    list(c.logprobs),
                    content,
                    c.finish_reason,
                    c.policy_version,
                )  # fmt: skip
            )
        with self._records_lock:
            self._records.setdefault(trajectory_id, []).extend(records)
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.cfg.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
            "system_fingerprint": f"policy-v{completions[0].policy_version}",
        }

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

    def _token_logprobs(self, c: Completion) -> list[dict[str, Any]]:
        out = []
        for tok, lp in zip(c.token_ids, c.logprobs):
            text = self.tokenizer.decode([tok])
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return out

    # -- the engine thread ------------------------------------------------------------------

    def _generate_loop(self) -> None:
        held: list[_Pending] = []  # requests that did not fit the last batch
        while not self._stop.is_set():
            if not held:
                try:
                    held.append(self._queue.get(timeout=0.1))
                except queue.Empty:
                    continue
            deadline = time.monotonic() + self.cfg.batch_wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    held.append(self._queue.get(timeout=left))
                except queue.Empty:
                    break
            while True:  # drain whatever else arrived
                try:
                    held.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            batch, held = self._take_batch(held)
            self._run(batch)

    def _take_batch(self, held: list[_Pending]) -> tuple[list[_Pending], list[_Pending]]:
        """The oldest request and every later one with the same sampling settings, up to max_batch."""
        live = [p for p in held if not p.future.cancelled()]
        if not live:
            return [], []
        key = live[0].params
        batch, rest, size = [], [], 0
        for p in live:
            if p.params == key and (not batch or size + p.n <= self.cfg.max_batch):
                batch.append(p)
                size += p.n
            else:
                rest.append(p)
        return batch, rest

    def _run(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        prompts = [p.prompt_ids for p in batch for _ in range(p.n)]
        try:
            with self._engine_lock:
                completions = self.engine.generate(prompts, batch[0].params, n=1)
        except Exception as e:  # a failed generate fails its requests, not the server
            logger.exception("generate failed")
            for p in batch:
                p.future.set_exception(e)
            return
        self.batch_sizes.append(len(prompts))
        start = 0
        for p in batch:
            p.future.set_result(completions[start : start + p.n])
            start += p.n


def _strip_stop(text: str, stop: Sequence[str]) -> str:
    """The text without the stop string that ended it (the engine keeps it; OpenAI does not)."""
    for s in stop:
        if s in text:
            return text[: text.find(s)]
    return text


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list")
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts")
        if content is None and not m.get("tool_calls"):
            raise RequestError(f"messages[{i}] has no content")
    return raw


def _int(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"'{key}' must be an integer in [{low}, {high}], got {value!r}")
    return value


def _float(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"'{key}' must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _handler_for(server: OpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients reuse the connection

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            logger.debug("%s " + format, self.address_string(), *args)

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, kind: str) -> None:
            self._send(status, {"error": {"message": message, "type": kind, "param": None, "code": None}})

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                model = {"id": server.cfg.model_name, "object": "model", "created": 0, "owned_by": "loopline"}
                self._send(200, {"object": "list", "data": [model]})
            else:
                self._error(404, f"no route GET {self.path}", "not_found_error")

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                self._error(404, f"no route POST {self.path}", "not_found_error")
                return
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                if body.get("stream"):
                    raise RequestError("stream=true is not supported")
                answer = server.complete(body, self.headers.get(server.cfg.trajectory_header) or "")
            except (json.JSONDecodeError, UnicodeDecodeError):
                self._error(400, "the request body is not valid JSON", "invalid_request_error")
            except RequestError as e:
                self._error(400, str(e), "invalid_request_error")
            except TimeoutError:
                self._error(503, "the engine did not answer in time", "server_error")
            except Exception as e:  # noqa: BLE001 - the client gets an answer, the server keeps serving
                logger.exception("chat completion failed")
                self._error(500, f"{type(e).__name__}: {e}", "server_error")
            else:
                self._send(200, answer)

    return Handler


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
