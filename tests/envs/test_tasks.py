"""The calculator task's validation split: what the agent's SFT stopping rule reads."""

from __future__ import annotations

import pytest

from loopline.envs.tasks import ToolTaskConfig, calculator_splits, calculator_validation


def test_validation_split_is_disjoint_and_leaves_the_other_splits_alone():
    cfg = ToolTaskConfig(num_train=300, num_eval=20, num_val=30)
    train, held_out = calculator_splits(cfg, seed=0)
    val = calculator_validation(cfg, seed=0)
    assert len(val) == 30 and [r.index for r in val] == list(range(30))
    assert {r.prompt for r in val}.isdisjoint({r.prompt for r in train + held_out})
    for row in val:
        a, rest = row.completion.split("*")
        b, c = rest.split("+")
        assert int(row.answer) == int(a) * int(b) + int(c)
    # the validation problems come after the others in the stream: train and held-out do not move
    assert calculator_splits(cfg.model_copy(update={"num_val": 0}), seed=0) == (train, held_out)


def test_validation_counts_toward_the_distinct_problems():
    with pytest.raises(ValueError, match="num_val"):
        ToolTaskConfig(min_operand=10, max_operand=20, max_addend=0, num_train=40, num_eval=10, num_val=20)
