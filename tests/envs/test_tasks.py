"""The calculator task (env.name=calculator): its problems, splits, verifier and demonstrations."""

from __future__ import annotations

import pytest

from loopline.data.datasets import PromptRow
from loopline.envs.multiturn import PlainFormat, demonstrations
from loopline.envs.tasks import (
    CalculatorConfig,
    answer_match,
    calculator_splits,
    calculator_validation,
    demonstration,
    make_env,
)


def test_problems_are_fixed_length_disjoint_and_reproducible():
    cfg = CalculatorConfig(num_train=300, num_eval=20)
    train, held_out = calculator_splits(cfg, seed=0)
    assert (len(train), len(held_out)) == (300, 20)
    assert calculator_splits(cfg, seed=0) == (train, held_out)
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    for row in train + held_out:
        a, rest = row.completion.split("*")
        b, c = rest.split("+")
        assert int(row.answer) == int(a) * int(b) + int(c)
        assert (
            len(row.completion) == 7 and len(row.answer) == 4 and row.prompt == f"What is {row.completion}?\n"
        )
    with pytest.raises(ValueError, match="distinct problems"):
        CalculatorConfig(min_operand=10, max_operand=12, num_train=100)


def test_answer_match():
    assert answer_match("<answer> 5573 </answer>", "5573") == 1.0
    assert answer_match("5573", "5573") == 0.0
    assert answer_match("<answer>5572</answer><answer>5573</answer>", "5573") == 0.0


@pytest.mark.parametrize("use_tool", [True, False])
def test_demonstrations_earn_full_reward_through_the_real_env(tokenizer, use_tool):
    row = PromptRow(0, "What is 87*64+5?\n", "5573", completion="87*64+5")
    (traj,) = demonstrations(
        [make_env()], [row], [demonstration(row, use_tool)], PlainFormat(tokenizer), tokenizer
    )
    assert traj.total_return() == 1.0 and traj.finish == "done"
    assert traj.info.get("tool_calls_ok", 0) == (1 if use_tool else 0)
    assert ("<tool_result>5573</tool_result>" in tokenizer.decode(traj.tokens)) == use_tool


def test_validation_split_is_disjoint_and_leaves_the_other_splits_alone():
    cfg = CalculatorConfig(num_train=300, num_eval=20, num_val=30)
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
        CalculatorConfig(min_operand=10, max_operand=20, max_addend=0, num_train=40, num_eval=10, num_val=20)
