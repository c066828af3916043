"""The token-budget planner (max_tokens_per_micro_batch): first-fit decreasing within the budget, deterministic,
split evenly to a count the ranks agree on, an oversize row refused, and rows cut out with their padding trimmed."""

from __future__ import annotations

import random

import pytest
import torch

from loopline.data.batches import collate
from loopline.data.token_budget import (
    even_out,
    padded_tokens,
    plan_micro_batches,
    row_lengths,
    select_rows,
)

pytestmark = pytest.mark.unit


def _lengths(seed: int, n: int = 40) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [rng.randint(1, 12) for _ in range(n)], [rng.randint(0, 30) for _ in range(n)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("budget", [42, 60, 200])
def test_every_row_once_and_every_bin_within_the_budget(budget: int, packed: bool) -> None:
    prompts, responses = _lengths(budget)
    bins = plan_micro_batches(prompts, responses, budget, packed)
    assert sorted(i for rows in bins for i in rows) == list(range(len(prompts)))
    for rows in bins:
        assert rows == sorted(rows)
        assert padded_tokens([prompts[i] for i in rows], [responses[i] for i in rows], packed) <= budget
    # first-fit decreasing on these lengths packs more than one row per bin on average
    assert len(bins) < len(prompts)
    assert plan_micro_batches(prompts, responses, budget, packed) == bins  # deterministic


def test_first_fit_decreasing_by_hand() -> None:
    # totals 10, 12, 6, 11; budget 24 padded tokens (rows x (longest prompt + longest response)):
    # row 1 (6+6) opens a bin; row 3 (4+7) does not fit beside it (2 x 13); row 0 (3+7) joins row 3 (2 x 11);
    # row 2 (2+4) joins row 1 (2 x 12)
    assert plan_micro_batches([3, 6, 2, 4], [7, 6, 4, 7], 24) == [[1, 2], [0, 3]]
    # packed: the sum of the rows' tokens, 39 in all
    assert plan_micro_batches([3, 6, 2, 4], [7, 6, 4, 7], 24, packed=True) == [[1, 3], [0, 2]]


def test_a_row_over_the_budget_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"grpo.max_tokens_per_micro_batch=10 .* a row of 11 tokens"):
        plan_micro_batches([3, 4], [5, 7], 10, field="grpo.max_tokens_per_micro_batch")
    assert plan_micro_batches([3, 4], [5, 7], 11) == [[1], [0]]


def test_even_out_reaches_the_agreed_count_within_the_budget() -> None:
    prompts, responses = _lengths(7)
    bins = plan_micro_batches(prompts, responses, 120)
    for count in (len(bins), len(bins) + 1, len(bins) + 5):
        parts = even_out(bins, count)
        assert len(parts) == count
        assert sorted(i for rows in parts for i in rows) == list(range(len(prompts)))
        assert all(padded_tokens([prompts[i] for i in r], [responses[i] for i in r]) <= 120 for r in parts)
    assert even_out([[0, 1, 2], [3]], 3) == [[0], [1, 2], [3]]  # the fullest bin halves, in place
    with pytest.raises(ValueError, match="cannot make 3"):
        even_out([[0], [1]], 3)


def test_select_rows_trims_the_padding_of_the_chosen_rows() -> None:
    batch = collate([[5, 6, 7], [8], [9, 10]], [[11, 12, 13, 14], [15], []], pad_id=0)  # P=3, C=4
    assert row_lengths(batch) == ([3, 1, 2], [4, 1, 0])
    part = select_rows(batch, [1, 2])
    assert part.input_ids.tolist() == [[0, 8, 15], [9, 10, 0]]  # 2 prompt columns, 1 response column
    assert part.attention_mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert part.response_mask.tolist() == [[1.0], [0.0]]
    whole = select_rows(batch, [0, 1, 2])
    assert torch.equal(whole.input_ids, batch.input_ids) and torch.equal(
        whole.response_mask, batch.response_mask
    )
