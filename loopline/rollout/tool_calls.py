"""Tool calls as text: how a model writes them (`ToolsConfig` tags) and how they are parsed back.

A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in the model's text (tags
configurable); `arguments` may also be a JSON string, as OpenAI clients send it. This is the rollout
layer's part of tool calling, shared by the chat-completions server (rollout.openai_server) and the
tool envs (envs.tools, which run the calls).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from loopline.data.transcripts import CALL_OPEN
from loopline.section import Section


class ToolsConfig(Section):
    """How tool calls are written and run."""

    call_open: str = Field(CALL_OPEN, description="Tag that opens a tool call in the model's text.")
    call_close: str = Field("</tool_call>", description="Tag that closes a tool call.")
    result_open: str = Field(
        "<tool_result>", description="Tag that opens a tool's result in the observation."
    )
    result_close: str = Field("</tool_result>", description="Tag that closes a tool's result.")
    max_calls_per_turn: int = Field(4, gt=0, description="Calls run per turn; later ones get an error.")
    max_result_chars: int = Field(2000, gt=0, description="A result longer than this keeps its tail.")
    timeout_s: float = Field(
        30.0, gt=0, description="A tool still running after this is answered with an error."
    )


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call found in the model's text."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A call tag whose content is not a valid call."""

    raw: str
    reason: str


def parse_tool_calls(text: str, cfg: ToolsConfig) -> list[ToolCall | MalformedCall]:
    """Every `call_open ... call_close` span of `text`, in order, parsed or explained."""
    calls: list[ToolCall | MalformedCall] = []
    pos = 0
    while (start := text.find(cfg.call_open, pos)) >= 0:
        body_start = start + len(cfg.call_open)
        end = text.find(cfg.call_close, body_start)
        if end < 0:
            calls.append(MalformedCall(text[start:], f"no closing {cfg.call_close}"))
            break
        calls.append(_parse_call(text[body_start:end]))
        pos = end + len(cfg.call_close)
    return calls


def _parse_call(body: str) -> ToolCall | MalformedCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return MalformedCall(body, 'expected a JSON object {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's wire format carries the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return MalformedCall(body, f"arguments string is not valid JSON ({e.msg})")
    if not isinstance(arguments, dict):
        return MalformedCall(body, f"arguments must be an object, got {type(arguments).__name__}")
    return ToolCall(data["name"], arguments)
