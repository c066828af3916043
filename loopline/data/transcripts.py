"""Transcripts: chat rows (data.messages_field) that record a whole multi-turn episode, for multi-turn SFT.

    system?  user  assistant  (tool | user)+  assistant  ...  assistant
    '----- first observation' model turn 1   observation 1    model turn 2 ...

A transcript is the text of an episode as the multi-turn driver (envs.multiturn) runs it: the system and user
messages before the first assistant message are the env's first observation (their contents in that order, as
`ToolEnv` puts its instructions before the prompt); each assistant message is one model turn, its tool calls written
in the model's format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, rollout.tool_calls); the tool
and user messages between two assistant messages are the env's observation after the first (their contents joined,
as `ToolEnv` joins its results), e.g. `<tool_result>42</tool_result>`. Messages after the last assistant one are
not trained on. Only this text layout is here; the tokens are envs.multiturn's (`transcript_trajectory`), built
exactly as a rollout builds an episode's sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")
# The tag that opens a tool call in the model's text: rollout.tool_calls.ToolsConfig.call_open's default
CALL_OPEN = "<tool_call>"


@dataclass(frozen=True)
class Turns:
    """A transcript's text as an episode: the first observation, then each model turn with the observation after
    it (None after the last model turn)."""

    first: str
    turns: tuple[tuple[str, str | None], ...]


def transcript_problem(messages: Sequence[dict[str, str]], need_assistant: bool = False) -> str:
    """What makes `messages` no valid chat row ('' when they are one): an unknown role, a system message after the
    conversation started, a tool message with no tool call before it, two assistant messages with no observation
    between them, no user message before the first assistant message; with `need_assistant`, no assistant message."""
    previous = ""  # the role of the message before, tool messages skipped
    for i, m in enumerate(messages, 1):
        role = m["role"]
        if role not in ROLES:
            return f"message {i}: unknown role '{role}' (use {', '.join(ROLES)})"
        if role == "system" and any(p["role"] != "system" for p in messages[: i - 1]):
            return (
                f"message {i}: a system message after the conversation started (system messages come first)"
            )
        if role == "tool" and (previous != "assistant" or CALL_OPEN not in _last(messages[: i - 1])):
            return (
                f"message {i}: a tool message with no tool call before it (the assistant message before it must "
                f"call a tool: {CALL_OPEN}{{...}})"
            )
        if role == "assistant" and i > 1 and messages[i - 2]["role"] == "assistant":
            return (
                f"message {i}: two assistant messages in a row (an observation, tool or user, comes between)"
            )
        if role == "assistant" and not any(p["role"] == "user" for p in messages[: i - 1]):
            return f"message {i}: an assistant message before any user message"
        if role != "tool":
            previous = role
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to learn (SFT trains on the assistant's messages)"
    return ""


def _last(messages: Sequence[dict[str, str]]) -> str:
    """The content of the last assistant message ('' when there is none)."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


def is_transcript(messages: Sequence[dict[str, str]], multi_turn: bool) -> bool:
    """Whether SFT trains on `messages` as a transcript (envs.multiturn.transcript_trajectory): in a multi-turn env
    every chat row with an assistant message; otherwise one with a tool message or more than one assistant message
    (a single exchange keeps the chat template's prompt and target, loops.sft.sft_pair)."""
    assistants = sum(m["role"] == "assistant" for m in messages)
    if multi_turn:
        return assistants > 0
    return assistants > 1 or (assistants == 1 and any(m["role"] == "tool" for m in messages))


def transcript_turns(messages: Sequence[dict[str, str]]) -> Turns:
    """The episode `messages` record (checked by transcript_problem): first observation, model turns, observations."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not starts:
        raise ValueError("a transcript needs an assistant message")
    first = "".join(m["content"] for m in messages[: starts[0]])
    turns = []
    for k, start in enumerate(starts):
        if k + 1 == len(starts):
            turns.append((messages[start]["content"], None))
        else:
            between = messages[start + 1 : starts[k + 1]]
            turns.append((messages[start]["content"], "".join(m["content"] for m in between)))
    return Turns(first, tuple(turns))


def first_user(messages: Sequence[dict[str, str]]) -> str:
    """The content of the first user message ('' when there is none): a transcript's prompt (PromptRow.prompt)."""
    return next((m["content"] for m in messages if m["role"] == "user"), "")
