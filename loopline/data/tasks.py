"""The built-in verifiable task: integer addition with an exact-match verifier.

Operands are zero-padded to max_digits and the sum to max_digits + 1 ("007+420=0427"): with digits
aligned by position a tiny model learns the carries in hundreds of steps instead of thousands.
"""

from __future__ import annotations

import random

from loopline.data.config import TaskConfig
from loopline.data.rows import PromptRow


def _operand(rng: random.Random, cfg: TaskConfig) -> int:
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _problems(cfg: TaskConfig, seed: int, count: int) -> list[PromptRow]:
    """The first `count` distinct 'a+b=' problems of the seed's stream (a longer list extends a shorter one)."""
    rng = random.Random(f"arithmetic-{seed}")
    seen: set[tuple[int, int]] = set()
    rows: list[PromptRow] = []
    while len(rows) < count:
        a, b = _operand(rng, cfg), _operand(rng, cfg)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        w = cfg.max_digits
        total = f"{a + b:0{w + 1}d}"
        rows.append(
            PromptRow(index=len(rows), prompt=f"{a:0{w}d}+{b:0{w}d}=", answer=total, completion=total + "\n")
        )
    return rows


def dropped_carries(a: int, b: int, width: int) -> str:
    """a + b written digit by digit with every carry dropped (each digit the sum of the operands' digits mod 10)."""
    digits = [(a // 10**i + b // 10**i) % 10 for i in range(width)]
    return "".join(str(d) for d in reversed(digits))


def _taught(row: PromptRow, cfg: TaskConfig, seed: int) -> PromptRow:
    """The row as the SFT teacher writes it: for a share (data.task.teacher_drops_carries) of the problems whose sum
    carries, the completion drops every carry; the answer the reward checks stays the true sum."""
    a, b = (int(x) for x in row.prompt[:-1].split("+"))
    sloppy = dropped_carries(a, b, cfg.max_digits + 1)
    if (
        sloppy == row.answer
        or random.Random(f"teacher-{seed}-{row.index}").random() >= cfg.teacher_drops_carries
    ):
        return row
    return PromptRow(row.index, row.prompt, row.answer, sloppy + "\n")


def _renumbered(rows: list[PromptRow]) -> list[PromptRow]:
    return [PromptRow(i, r.prompt, r.answer, r.completion) for i, r in enumerate(rows)]


def arithmetic_splits(cfg: TaskConfig, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """Disjoint train and held-out splits of 'a+b=' prompts, the same for the same seed."""
    rows = _problems(cfg, seed, cfg.num_train + cfg.num_eval + cfg.num_val)
    train = rows[: cfg.num_train]
    if cfg.teacher_drops_carries:
        train = [_taught(row, cfg, seed) for row in train]
    return train, _renumbered(rows[cfg.num_train : cfg.num_train + cfg.num_eval])


def arithmetic_validation(cfg: TaskConfig, seed: int) -> list[PromptRow]:
    """num_val problems disjoint from both splits (the stream's next ones): SFT's stopping rule reads them, so
    the held-out split stays untouched by any choice the run makes."""
    rows = _problems(cfg, seed, cfg.num_train + cfg.num_eval + cfg.num_val)
    return _renumbered(rows[cfg.num_train + cfg.num_eval :])


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion's first line equals the answer (surrounding spaces ignored), else 0.0."""
    first_line = completion.split("\n", 1)[0]
    return 1.0 if first_line.strip() == answer.strip() else 0.0
