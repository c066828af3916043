"""Dispatch declared on the worker method: how a call's arguments go out to a group's ranks and how its results
come back, said once where the method is written (`@dispatch(...)`) and applied by `WorkerGroup.run`.

The ranks of a group form a (pp, dp, tp) mesh (`RankMesh`; rank (s*dp + i)*tp + j is pipeline stage s of data-
parallel rank i, tensor-parallel rank j): a batch is split in equal rows over the dp ranks, and the tp ranks and
pipeline stages of a dp rank get the same slice. The decorator only records the rule on the function; it does not
wrap it, so a worker method runs as written on its rank.

Simplified on purpose: only the first argument is split (a batch with `len`, `split` and `select`: TokenBatch,
RolloutBatch, PairBatch); the others go to every rank as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

Split = Literal["all", "rows", "any_rows"]
Gather = Literal["first", "all", "concat"]


@dataclass(frozen=True)
class Dispatch:
    """How one worker method's call is spread over the ranks and its results put back together.

    split: "all" = every rank gets the arguments as given; "rows" = the first argument (a batch) in equal row
    slices over the dp ranks (its length must divide); "any_rows" = the same for a batch of any length (its last
    row repeated up to a multiple of the dp ranks, the repeats dropped from the result).
    gather: "first" = rank 0's result (the ranks agree: global step statistics, whole weights gathered on rank 0);
    "all" = every rank's, in rank order; "concat" = one result per dp rank concatenated along rows (a tuple of
    tensors: each element concatenated).
    train: the call takes one optimizer step of the phase (a heal that finds it committed does not run it again).
    """

    split: Split = "all"
    gather: Gather = "all"
    train: bool = False


def dispatch(split: Split = "all", gather: Gather = "all", train: bool = False) -> Callable[[F], F]:
    """Declare on a worker method how WorkerGroup.run spreads its calls (see Dispatch); the method is unchanged."""
    rule = Dispatch(split, gather, train)
    if split == "any_rows" and gather != "concat":
        raise ValueError(
            "split='any_rows' drops the repeated rows from the results: it needs gather='concat'"
        )

    def mark(fn: F) -> F:
        fn.__dispatch__ = rule  # type: ignore[attr-defined]
        return fn

    return mark


def rule_of(cls: type, method: str) -> Dispatch:
    """The Dispatch declared on `cls.method`; a method without one goes to every rank and gives back every result."""
    return getattr(getattr(cls, method, None), "__dispatch__", Dispatch())


@dataclass(frozen=True)
class RankMesh:
    """The (pp, dp, tp) shape of a group's ranks: tp ranks split the model and share a slice, pp ranks are the
    stages of one pipeline; dp is what is left of the group's size."""

    tp: int = 1
    pp: int = 1

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)


def split_args(
    rule: Dispatch, mesh: RankMesh, world_size: int, args: tuple[Any, ...]
) -> tuple[list[tuple[Any, ...]], int]:
    """The arguments of every rank, in rank order, and the rows of the batch split (0: nothing split)."""
    if rule.split == "all":
        return [args] * world_size, 0
    batch, rest = args[0], args[1:]
    dp, rows = mesh.dp(world_size), len(args[0])
    if rule.split == "any_rows" and rows % dp:  # the last row repeated up to a multiple of dp
        batch = batch.select(torch.cat([torch.arange(rows), torch.full(((-rows) % dp,), rows - 1)]))
    elif rows % dp:
        raise ValueError(f"a batch of {rows} rows does not split evenly over {dp} trainer ranks")
    slices = batch.split(len(batch) // dp)
    return [(s, *rest) for s in slices for _ in range(mesh.tp)] * mesh.pp, rows


def gather(rule: Dispatch, mesh: RankMesh, outs: list[Any], rows: int) -> Any:
    """The call's result from every rank's (`rows`: the batch's own rows, to drop padding from a concat)."""
    if rule.gather == "first":
        return outs[0]
    if rule.gather == "all":
        return outs
    per_dp = outs[: mesh.dp(len(outs)) * mesh.tp : mesh.tp]  # a dp rank's tp ranks and stages agree
    if isinstance(per_dp[0], tuple):
        return tuple(torch.cat(parts)[: rows or None] for parts in zip(*per_dp))
    return torch.cat(per_dp)[: rows or None]
