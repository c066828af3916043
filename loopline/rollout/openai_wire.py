"""The OpenAI wire format, apart from the server that speaks it: request fields checked one by one (a bad one is
a RequestError, answered 400), the built-in chat format, text cut at token boundaries for streaming, and the
response pieces (messages, usage, error objects, Server-Sent Events)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from loopline.rollout.engine import Completion
from loopline.rollout.tool_calls import ToolsConfig

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the server refuses; the message goes back to the client with status 400."""


def builtin_chat_format(messages: Sequence[Mapping[str, Any]], eos: str) -> str:
    """`<|role|>` header, newline, content, EOS per message; then `<|assistant|>` and a newline.

    A message is closed by the EOS text so that an assistant turn the model ended with EOS renders
    back to the very tokens it sampled (for byte-level tokenizers), and the next call continues it.
    """
    parts = [f"<|{m['role']}|>\n{message_text(m)}{eos}" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def message_text(message: Mapping[str, Any]) -> str:
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


def text_deltas(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], content: str
) -> list[tuple[str, int]]:
    """`content` cut at token boundaries for streaming: (piece, tokens consumed so far) per piece.

    The pieces join to `content` exactly. A piece is cut once the tokens since the last cut decode
    to whole characters (a byte-level tokenizer splits a character over tokens; decoding with the
    previous piece's tokens as context keeps word-piece spacing right). Text that does not continue
    `content` (a stop string removed from it) ends the cutting: the rest goes out as one last piece.
    """
    out: list[tuple[str, int]] = []
    emitted, prefix, read = 0, 0, 0  # characters sent; token window [prefix, read) is the context
    before = ""
    for k in range(1, len(token_ids) + 1):
        now = decode_ids(tokenizer, token_ids[prefix:k])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            continue
        piece = now[len(before) :]
        if not content.startswith(piece, emitted):
            break
        out.append((piece, k))
        emitted += len(piece)
        prefix, read = read, k
        before = decode_ids(tokenizer, token_ids[prefix:read])
    if emitted < len(content):
        out.append((content[emitted:], len(token_ids)))
    return out


def text_offsets(tokenizer: PreTrainedTokenizerBase, c: Completion) -> list[int]:
    """Where each token of `c` starts in its text (a token inside a character split over several tokens
    gets that character's start), in one pass."""
    offsets: list[int] = []
    at = 0
    for piece, upto in text_deltas(tokenizer, c.token_ids, c.text):
        offsets += [at] * (upto - len(offsets))
        at += len(piece)
    return offsets + [at] * (len(c.token_ids) - len(offsets))


def decode_ids(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], skip_special: bool = True) -> str:
    return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special))


@dataclass
class Choice:
    """One completion as answered: what the client sees of it."""

    completion: Completion
    content: str  # the text (stop string removed), tool calls included
    shown: str | None  # message content: the text before the first tool call when there are calls
    tool_calls: list[dict[str, Any]]
    finish_reason: str


async def json_body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def sse_response(request: web.Request, events: Iterator[dict[str, Any]]) -> web.StreamResponse:
    """`events` as Server-Sent Events (`data: {json}` each), then `data: [DONE]`."""
    response = web.StreamResponse(headers={"Cache-Control": "no-cache"})
    response.content_type = "text/event-stream"
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    try:
        await response.prepare(request)
        await response.write(data)  # the turn is already generated: one write carries every chunk
        await response.write_eof()
    except ConnectionResetError:
        logger.debug("client left during a stream")
    return response


def then(events: Iterator[dict[str, Any]], last: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from events
    yield last


def error_response(status: int, message: str, kind: str) -> web.Response:
    payload = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(payload, status=status)


def message_of(ch: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ch.shown}
    if ch.tool_calls:
        message["tool_calls"] = ch.tool_calls
    return message


def usage_of(prompt: list[int], completions: list[Completion]) -> dict[str, int]:
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion_tokens,
        "total_tokens": len(prompt) + completion_tokens,
    }


def strip_stop(text: str, stop: Sequence[str]) -> str:
    """The text without the stop string that ended it (the engine keeps it; OpenAI does not)."""
    for s in stop:
        if s in text:
            return text[: text.find(s)]
    return text


def parse_messages(raw: Any) -> list[dict[str, Any]]:
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


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream = body_bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict) or not stream:
        raise RequestError("'stream_options' must be an object, and only given with stream=true")
    return stream, body_bool(options, "include_usage")


def body_bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{key}' must be a boolean, got {value!r}")
    return bool(value)


def body_int(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"'{key}' must be an integer in [{low}, {high}], got {value!r}")
    return value


def body_float(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"'{key}' must be a number in [{low}, {high}], got {value!r}")
    return float(value)
