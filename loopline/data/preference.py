"""Preference pairs (prompt, chosen, rejected) for DPO and reward models: jsonl files, or the built-in task.

A jsonl row holds, under the configured field names, either plain text
    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
or chat messages (TRL's conversational format), the prompt's messages given apart or as the shared turns
before the last assistant message of each side:
    {"prompt": [{"role": "user", "content": "2+2="}], "chosen": [{"role": "assistant", "content": "4"}], ...}
    {"chosen": [{"role": "user", ...}, {"role": "assistant", "content": "4"}], "rejected": [...]}
An optional numeric margin field gives the reward model's Bradley-Terry margin for that pair.

Built-in pairs: the task's prompts with chosen = the correct sum and rejected = a plausible wrong one
(one digit changed, off by one or ten, a dropped carry), zero-padded like the answer; or, with
preference.rejected=policy, the policy's own wrong samples (policy_pairs), the mistakes RL will meet.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loopline.data.batches import TokenBatch
from loopline.data.config import PreferenceDataConfig
from loopline.data.datasets import DataError, PromptRow

Messages = tuple[dict[str, str], ...]


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: two completions of a prompt, the first preferred."""

    index: int  # position in its split
    prompt: str
    chosen: str
    rejected: str
    messages: Messages = ()  # the prompt as chat messages (then `prompt` is unused)
    margin: float = 0.0  # Bradley-Terry margin: how much better chosen is (reward models)


def wrong_sum(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer of the same width: a digit changed, off by 1 or 10, or a carry dropped."""
    width, value = len(answer), int(answer)
    for _ in range(20):
        kind = rng.randrange(4)
        if kind == 0:  # one digit changed
            pos = rng.randrange(width)
            digit = rng.choice([d for d in "0123456789" if d != answer[pos]])
            wrong = int(answer[:pos] + digit + answer[pos + 1 :])
        elif kind == 1:
            wrong = value + rng.choice([-1, 1])
        elif kind == 2:
            wrong = value + rng.choice([-10, 10])
        else:  # a carry dropped: one power of ten too few
            wrong = value - 10 ** rng.randrange(1, width)
        if wrong != value and 0 <= wrong < 10**width:
            return f"{wrong:0{width}d}"
    return f"{(value + 1) % 10**width:0{width}d}"


def builtin_pairs(rows: list[PromptRow], seed: int, limit: int | None = None) -> list[PreferencePair]:
    """One pair per task row (the first `limit`): chosen = the true sum, rejected = a wrong sum, in the SFT target's
    format (not the target itself: data.task.teacher_drops_carries makes some targets wrong)."""
    rng = random.Random(f"pairs-{seed}")
    pairs: list[PreferencePair] = []
    for row in rows[:limit]:
        suffix = row.completion[len(row.answer) :]  # what follows the sum in the SFT target ("\n")
        pairs.append(
            PreferencePair(len(pairs), row.prompt, row.answer + suffix, wrong_sum(row.answer, rng) + suffix)
        )
    return pairs


def policy_pairs(
    rows: list[PromptRow], samples: list[list[str]], correct: list[list[bool]], seed: int
) -> list[PreferencePair]:
    """Pairs from the policy's samples of each row: chosen = the row's SFT target, rejected = each distinct
    wrong sample, in sample order. A row whose samples were all right gets one synthetic wrong sum instead.

    A reward model that only ever saw synthetic wrong sums learns their quirks and misses the policy's own
    mistakes (measured: RL against such a model drove answers to a leading "1" it had learned to like).
    """
    if not len(rows) == len(samples) == len(correct):
        raise ValueError(f"need one sample list per row: {len(rows)} rows, {len(samples)}, {len(correct)}")
    rng = random.Random(f"policy-pairs-{seed}")
    pairs: list[PreferencePair] = []
    for row, texts, right in zip(rows, samples, correct):
        if len(texts) != len(right):
            raise ValueError(f"row {row.index}: {len(texts)} samples but {len(right)} verdicts")
        wrong = list(dict.fromkeys(t for t, ok in zip(texts, right) if not ok))  # distinct, in order
        if not wrong:
            wrong = [wrong_sum(row.answer, rng) + row.completion[len(row.answer) :]]
        for w in wrong:
            pairs.append(PreferencePair(len(pairs), row.prompt, row.completion, w, row.messages))
    return pairs


def _side(value: Any, field: str) -> tuple[str, Messages]:
    """A completion given as text or chat messages: (the last assistant message's text, the turns before)."""
    if isinstance(value, str):
        return value, ()
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        if value[-1].get("role") != "assistant":
            raise ValueError(f"field '{field}': the last message must be the assistant's")
        return str(value[-1].get("content", "")), tuple(dict(m) for m in value[:-1])
    raise ValueError(f"field '{field}' must be a string or a list of chat messages")


def _pair(index: int, raw: Any, cfg: PreferenceDataConfig) -> PreferencePair:
    if not isinstance(raw, dict):
        raise ValueError("row is not a JSON object")
    for key in (cfg.chosen_field, cfg.rejected_field):
        if key not in raw:
            raise ValueError(f"missing field '{key}'")
    chosen, chosen_turns = _side(raw[cfg.chosen_field], cfg.chosen_field)
    rejected, rejected_turns = _side(raw[cfg.rejected_field], cfg.rejected_field)
    prompt = raw.get(cfg.prompt_field, "")
    if isinstance(prompt, list):
        messages: Messages = tuple(dict(m) for m in prompt)
        prompt = ""
    else:
        if chosen_turns != rejected_turns:
            raise ValueError("chosen and rejected messages differ before the last assistant turn")
        messages = chosen_turns
    if not prompt and not messages:
        raise ValueError(f"no prompt: give field '{cfg.prompt_field}' or the turns before the answer")
    margin = float(raw.get(cfg.margin_field, 0.0)) if cfg.margin_field else 0.0
    return PreferencePair(index, str(prompt), chosen, rejected, messages, margin)


def load_pairs(path: str | Path, cfg: PreferenceDataConfig) -> list[PreferencePair]:
    """Pairs from a jsonl file; a malformed row raises DataError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"preference file '{path}' does not exist")
    pairs: list[PreferencePair] = []
    # bytes, decoded per row: a bad byte is a bad row, named (UnicodeDecodeError is a ValueError)
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                pairs.append(_pair(len(pairs), json.loads(line.decode("utf-8")), cfg))
            except (json.JSONDecodeError, ValueError, TypeError) as e:
                raise DataError(f"{path}: row {lineno}: {e}") from None
    if not pairs:
        raise DataError(f"preference file '{path}' has no rows")
    return pairs


def load_pair_splits(
    cfg: PreferenceDataConfig, train_rows: list[PromptRow], eval_rows: list[PromptRow], seed: int
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs: from the files, or built from the task's train and held-out prompts."""
    if cfg.source == "builtin":
        return builtin_pairs(train_rows, seed, cfg.num_train), builtin_pairs(eval_rows, seed + 1)
    train = load_pairs(cfg.train_path, cfg)
    return train, (load_pairs(cfg.eval_path, cfg) if cfg.eval_path else [])


@dataclass
class PairBatch:
    """B preference pairs as two token batches, row i of each the same pair."""

    chosen: TokenBatch  # prompt + chosen completion
    rejected: TokenBatch  # prompt + rejected completion
    margin: torch.Tensor  # (B,) Bradley-Terry margin of each pair
    ref_chosen: torch.Tensor | None = None  # (B,) summed reference log-probs of the chosen completion (DPO)
    ref_rejected: torch.Tensor | None = None  # (B,) the same for the rejected one

    def __len__(self) -> int:
        return len(self.chosen)

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PairBatch:
        """The pairs with `fn` applied to every tensor (the two token batches' fields included)."""
        ref_c, ref_r = self.ref_chosen, self.ref_rejected
        return PairBatch(
            self.chosen.apply(fn),
            self.rejected.apply(fn),
            fn(self.margin),
            None if ref_c is None else fn(ref_c),
            None if ref_r is None else fn(ref_r),
        )

    def select(self, rows: torch.Tensor | slice) -> PairBatch:
        """The pairs `rows` (an index tensor or a slice)."""
        return self.apply(lambda v: v[rows])

    def split(self, size: int) -> list[PairBatch]:
        """Consecutive slices of at most `size` pairs, in order."""
        return [self.select(slice(start, start + size)) for start in range(0, len(self), size)]

    def to(self, device: torch.device) -> PairBatch:
        """The pairs with every tensor on `device`."""
        return self.apply(lambda v: v.to(device))

    def micro_batches(self, size: int) -> list[PairBatch]:
        """Consecutive slices of at most `size` pairs (`split`)."""
        return self.split(size)
