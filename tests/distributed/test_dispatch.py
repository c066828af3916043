"""Dispatch declared on the worker method: which rows each rank of a (pp, dp, tp) mesh gets, and what comes back."""

from __future__ import annotations

import pytest
import torch

from loopline.data.batches import collate
from loopline.distributed.dispatch import Dispatch, RankMesh, dispatch, gather, rule_of, split_args
from loopline.distributed.workers import LocalGroup

pytestmark = pytest.mark.unit


def _batch(rows: int):
    """A TokenBatch whose row i holds token i + 1 (so a slice names its rows)."""
    return collate([[i + 1] for i in range(rows)], [[0]] * rows, pad_id=0)


def _rows(batch) -> list[int]:
    return batch.input_ids[:, 0].tolist()


def test_rows_go_to_dp_ranks_shared_by_their_tp_ranks_on_every_stage():
    mesh = RankMesh(tp=2, pp=2)  # 8 ranks: rank (s*dp + i)*tp + j is stage s of dp rank i, tp rank j; dp = 2
    per_rank, rows = split_args(Dispatch("rows", "concat"), mesh, 8, (_batch(4), 0.5))
    assert rows == 4 and [a[1] for a in per_rank] == [0.5] * 8
    assert [_rows(a[0]) for a in per_rank] == [[1, 2], [1, 2], [3, 4], [3, 4]] * 2
    # one result per dp rank (ranks 0 and 2), in order; a tuple result is concatenated element by element
    outs = [torch.tensor([10.0 * r]) for r in range(8)]
    assert gather(Dispatch("rows", "concat"), mesh, outs, rows).tolist() == [0.0, 20.0]
    pairs = [(torch.tensor([r]), torch.tensor([-r])) for r in range(8)]
    first, second = gather(Dispatch("rows", "concat"), mesh, pairs, rows)
    assert first.tolist() == [0, 2] and second.tolist() == [0, -2]
    assert gather(Dispatch("rows", "first"), mesh, outs, rows).tolist() == [0.0]


def test_any_rows_repeats_the_last_row_and_drops_the_repeats():
    mesh = RankMesh()
    per_rank, rows = split_args(Dispatch("any_rows", "concat"), mesh, 2, (_batch(3),))
    assert rows == 3 and [_rows(a[0]) for a in per_rank] == [[1, 2], [3, 3]]
    outs = [a[0].input_ids[:, 0].float() for a in per_rank]
    assert gather(Dispatch("any_rows", "concat"), mesh, outs, rows).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="a batch of 3 rows does not split evenly over 2 trainer ranks"):
        split_args(Dispatch("rows", "concat"), mesh, 2, (_batch(3),))


class Doubler:
    """A worker whose methods declare their dispatch."""

    @dispatch(split="rows", gather="concat")
    def double(self, batch) -> torch.Tensor:
        return batch.input_ids[:, 0] * 2

    @dispatch(gather="first")
    def hello(self, name: str) -> str:
        return f"hello {name}"

    def plain(self) -> int:
        return 7


def test_a_group_applies_the_method_s_rule():
    group = LocalGroup(Doubler, role="critic")
    assert group.run("double", _batch(3)).tolist() == [2, 4, 6]
    assert group.run("hello", "x") == "hello x" and group.run("plain") == [7]  # no rule: every rank's result
    assert rule_of(Doubler, "plain") == Dispatch() and rule_of(Doubler, "double").split == "rows"
    with pytest.raises(ValueError, match="needs gather='concat'"):
        dispatch(split="any_rows", gather="first")
