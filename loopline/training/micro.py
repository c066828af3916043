"""A trainer step's micro-batches: fixed row counts (micro_batch_size), or rows grouped by token count within a
budget (max_tokens_per_micro_batch, loopline.data.token_budget) with every data-parallel rank given as many.

The losses keep their normalisation: each micro-batch's mean is weighted by its share of the global batch's
tokens or rows, so how rows are grouped changes the sums' order only, never the step's loss or gradients.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from loopline.data.batches import TokenBatch, split_rows
from loopline.data.preference import PairBatch
from loopline.data.token_budget import (
    even_out,
    longest_row,
    pair_lengths,
    plan_micro_batches,
    row_lengths,
    row_over_budget,
    select_pairs,
    select_rows,
)

B = TypeVar("B", bound=TokenBatch)


def agreed_plan(
    prompts: list[int],
    responses: list[int],
    budget: int,
    packed: bool,
    group: dist.ProcessGroup | None,
    field: str,
) -> list[list[int]]:
    """This rank's bins, as many as the rank with the most (one all_reduce MAX over `group` of the bin count and
    the longest row): every rank raises together when a row anywhere exceeds the budget, rather than leaving its
    peers waiting in a collective."""
    longest = longest_row(prompts, responses, packed)
    bins = plan_micro_batches(prompts, responses, budget, packed, field) if longest <= budget else []
    agreed = torch.tensor([len(bins), longest], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    count, longest = agreed.tolist()
    if longest > budget:
        raise row_over_budget(field, budget, longest)
    return even_out(bins, count)


def micro_batches(
    batch: B,
    rows: int,
    budget: int = 0,
    packed: bool = False,
    group: dist.ProcessGroup | None = None,
    field: str = "max_tokens_per_micro_batch",
) -> list[B]:
    """`batch` as micro-batches: `rows` rows each (budget 0), else within `budget` padded tokens each."""
    if not budget:
        return split_rows(batch, rows)
    prompts, responses = row_lengths(batch)
    return [
        select_rows(batch, part) for part in agreed_plan(prompts, responses, budget, packed, group, field)
    ]


def pair_micro_batches(
    pairs: PairBatch,
    rows: int,
    budget: int = 0,
    packed: bool = False,
    group: dist.ProcessGroup | None = None,
    field: str = "max_tokens_per_micro_batch",
) -> list[PairBatch]:
    """`pairs` as micro-batches: `rows` pairs each (budget 0), else within `budget` padded tokens per forward."""
    if not budget:
        return pairs.micro_batches(rows)
    prompts, responses = pair_lengths(pairs)
    return [
        select_pairs(pairs, part) for part in agreed_plan(prompts, responses, budget, packed, group, field)
    ]
