"""Transcripts (chat rows recording a whole episode) tokenize exactly as the multi-turn rollout builds that episode.

The rollout side is the real driver (`run_rollout`) on the real ToolEnv, whose engine replays the transcript's
assistant messages as token ids (a model cannot be made to write given text; every other part is the one that
runs in RL). Bad rows fail at load, naming the file, the row and the problem.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from loopline.data.config import DataConfig
from loopline.data.datasets import DataError, load_rows
from loopline.data.rows import PromptRow
from loopline.data.transcripts import is_transcript, transcript_turns
from loopline.envs.multiturn import (
    ChatFormat,
    MultiTurnConfig,
    PlainFormat,
    run_rollout,
    to_batch,
    transcript_trajectory,
)
from loopline.envs.tasks import answer_match, tool_call_text
from loopline.envs.tools import Toolbox, ToolEnv, describe_tools
from loopline.rollout.engine import Completion, SamplingParams


def convert(amount: int, unit: str) -> int:
    """Convert km to m or kg to g."""
    return amount * {"km": 1000, "kg": 1000}[unit]


TOOLBOX = Toolbox([convert])


def make_env() -> ToolEnv:
    return ToolEnv(TOOLBOX, answer_match, instructions=describe_tools(TOOLBOX) + "\n")


def transcript() -> tuple[PromptRow, list[dict[str, str]]]:
    """An episode of the env, run for real: two calls in one turn (two tool messages), then the answer."""
    prompt = "How many m in 7 km, and g in 3 kg?\n"
    calls = tool_call_text("convert", {"amount": 7, "unit": "km"}) + tool_call_text(
        "convert", {"amount": 3, "unit": "kg"}
    )

    async def step() -> str:
        env = make_env()
        await env.reset(PromptRow(0, prompt, "7000 3000"))
        return (await env.step(calls)).observation

    observation = asyncio.run(step())
    results = observation.split("</tool_result>")[:2]
    messages = [
        {"role": "system", "content": describe_tools(TOOLBOX) + "\n"},
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": calls},
        *({"role": "tool", "content": r + "</tool_result>"} for r in results),
        {"role": "assistant", "content": "<answer>7000 3000</answer>"},
    ]
    return PromptRow(0, prompt, "7000 3000", messages=tuple(messages)), messages


class ReplayEngine:
    """An engine whose samples are given: turn k of every call returns `turns[k]`'s ids (the Engine protocol)."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.prompts = turns, []

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        self.prompts.append(prompts[0])
        ids = self.turns[len(self.prompts) - 1]
        return [Completion(0, 0, ids, [0.0] * len(ids), "", "stop")]

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
def test_a_transcript_tokenizes_as_the_rollout_builds_its_episode(tokenizer, chat: bool) -> None:
    tok = copy.deepcopy(tokenizer)
    if chat:
        tok.chat_template = TEMPLATE
    fmt = ChatFormat(tok) if chat else PlainFormat(tok)
    row, messages = transcript()
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    turn_ids = [tok(a, add_special_tokens=False)["input_ids"] for a in assistant]
    turn_ids[-1] = turn_ids[-1] + [tok.eos_token_id]  # the model ends the episode with EOS

    sft = transcript_trajectory(row, fmt, tok)
    (rl,) = run_rollout(
        ReplayEngine(turn_ids),
        [make_env()],
        [row],
        fmt,
        MultiTurnConfig(max_turns=4, max_turn_tokens=200, max_total_tokens=2000),
    )

    assert rl.finish == "done" and rl.rewards == [0.0, 1.0]  # the env ran the calls and took the answer
    assert sft.prompt_ids == rl.prompt_ids and sft.tokens == rl.tokens and sft.mask == rl.mask
    # the loss mask covers exactly the assistant's tokens, and the observation between them is the env's
    trained = [t for t, m in zip(sft.tokens, sft.mask) if m]
    assert trained == [t for ids in turn_ids for t in ids]
    masked = tok.decode([t for t, m in zip(sft.tokens, sft.mask) if not m])
    assert "<tool_result>7000</tool_result><tool_result>3000</tool_result>" in masked
    # and as a training batch: the response mask is the trajectory's mask, the prompt is left out of it
    batch = to_batch([sft], tok.pad_token_id)[0]
    assert batch.response_mask[0].tolist() == [float(m) for m in sft.mask]
    assert batch.input_ids[0, -len(sft.tokens) :].tolist() == sft.tokens


def test_transcript_turns_join_the_first_observation_and_each_observation() -> None:
    _, messages = transcript()
    turns = transcript_turns(messages)
    assert turns.first == messages[0]["content"] + messages[1]["content"]
    assert [a for a, _ in turns.turns] == [messages[2]["content"], messages[5]["content"]]
    assert turns.turns[0][1] == messages[3]["content"] + messages[4]["content"] and turns.turns[1][1] is None
    single = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    assert is_transcript(messages, multi_turn=False) and is_transcript(single, multi_turn=True)
    assert not is_transcript(single, multi_turn=False)  # one exchange: the chat template's prompt and target


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _call(n: int) -> str:
    return tool_call_text("convert", {"amount": n, "unit": "km"})


GOOD = [
    {"role": "user", "content": "7 km?"},
    {"role": "assistant", "content": _call(7)},
    {"role": "tool", "content": "<tool_result>7000</tool_result>"},
    {"role": "assistant", "content": "<answer>7000</answer>"},
]


@pytest.mark.parametrize(
    "messages, problem",
    [
        ([GOOD[0], {"role": "robot", "content": "x"}, *GOOD[1:]], "message 2: unknown role 'robot'"),
        (
            [GOOD[0], {"role": "assistant", "content": "let me see"}, *GOOD[2:]],
            "message 3: a tool message with no tool call before it",
        ),
        ([GOOD[0], GOOD[2], GOOD[3]], "message 2: a tool message with no tool call before it"),
        ([GOOD[0], GOOD[1], GOOD[3]], "message 3: two assistant messages in a row"),
        (
            [*GOOD[:3], {"role": "system", "content": "be brief"}, GOOD[3]],
            "message 4: a system message after",
        ),
        ([{"role": "system", "content": "s"}, GOOD[1]], "message 2: an assistant message before any user"),
        ([GOOD[0]], "no assistant message: nothing to learn"),
    ],
    ids=[
        "unknown-role",
        "tool-after-no-call",
        "tool-first",
        "two-assistants",
        "late-system",
        "no-user",
        "none",
    ],
)
def test_a_bad_transcript_row_is_one_error_naming_the_row_and_the_problem(
    tmp_path: Path, messages: list[dict[str, str]], problem: str
) -> None:
    path = _write(tmp_path / "t.jsonl", [{"messages": GOOD}, {"messages": messages}])
    cfg = DataConfig(source="jsonl", train_path=str(path))
    with pytest.raises(DataError, match=f"t.jsonl: row 2: field 'messages': {problem}"):
        load_rows(path, cfg, need_answer=False)


def test_good_transcript_rows_load_with_their_first_user_message_as_the_prompt(tmp_path: Path) -> None:
    rows_in = [{"messages": GOOD, "answer": "7000"}, {"messages": GOOD[:1], "answer": "7000"}]
    rows, _ = load_rows(_write(tmp_path / "t.jsonl", rows_in), DataConfig(source="jsonl"), need_answer=True)
    assert rows[0].prompt == "7 km?" and rows[0].messages == tuple(GOOD) and rows[0].answer == "7000"
    assert rows[1].prompt == ""  # a chat prompt for RL (no assistant message) keeps its messages alone
