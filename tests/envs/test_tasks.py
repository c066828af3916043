"""The env section's built-in tasks: the calculator (env.name=calculator: its problems, splits, verifier and
demonstrations) and one-line functions (env.name=code: problems whose reference passes its tests in the sandbox)."""

from __future__ import annotations

import pytest

from loopline.data.datasets import PromptRow
from loopline.envs.code import CodeProblem, score
from loopline.envs.config import CodeTaskConfig
from loopline.envs.multiturn import PlainFormat, demonstrations
from loopline.envs.tasks import (
    CalculatorConfig,
    answer_match,
    calculator_splits,
    calculator_validation,
    code_splits,
    code_validation,
    demonstration,
    function_source,
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


@pytest.mark.parametrize(
    ("steps", "source"),
    [
        ([("add", 4), ("mul", 3), ("sub", 2)], "(x + 4) * 3 - 2"),
        ([("add", 4), ("sub", 2), ("mod", 3)], "(x + 4 - 2) % 3"),
        ([("mul", 3), ("add", 4), ("div", 2)], "(x * 3 + 4) // 2"),
        ([("div", 3), ("mod", 5), ("sub", 7)], "x // 3 % 5 - 7"),
        ([("sub", 9)], "x - 9"),
    ],
)
def test_function_source_parenthesises_only_where_precedence_needs_it(steps, source):
    assert function_source(steps) == source
    x = -17  # the steps applied one by one, in order, as Python's operators (floor division, remainder)
    for kind, k in steps:
        x = {"add": x + k, "sub": x - k, "mul": x * k, "div": x // k, "mod": x % k}[kind]
    assert eval(source, {"x": -17}) == x


def _problem(row: PromptRow) -> CodeProblem:
    return CodeProblem(f"code/{row.index}", row.prompt, row.get("entry_point"), row.get("test"))


@pytest.mark.sandbox  # the references run in the sandbox (the rest of this module: unit)
def test_code_problems_are_disjoint_reproducible_and_their_reference_passes_in_the_sandbox():
    cfg = CodeTaskConfig(num_train=200, num_eval=20, num_val=10)
    train, held_out = code_splits(cfg, seed=0)
    val = code_validation(cfg, seed=0)
    assert (len(train), len(held_out), len(val)) == (200, 20, 10) and code_splits(cfg, seed=0) == (
        train,
        held_out,
    )
    bodies = [{r.completion for r in split} for split in (train, held_out, val)]
    assert not (bodies[0] & bodies[1] or bodies[0] & bodies[2] or bodies[1] & bodies[2])
    assert code_splits(cfg.model_copy(update={"num_val": 0}), seed=0) == (train, held_out)
    for row in held_out[:4] + val[:2]:
        assert row.prompt.startswith('def f(x):\n    """Start with x, ') and row.get("entry_point") == "f"
        assert row.get("test").count("assert candidate(") == cfg.num_tests
        assert score(_problem(row), row.completion).passed
    # the tests tell precedence apart: the same steps without their parentheses fail
    row = next(r for r in held_out if "(" in r.completion)
    assert not score(_problem(row), row.completion.replace("(", "").replace(")", "")).passed


def test_code_task_config_refuses_impossible_counts():
    with pytest.raises(ValueError, match="distinct problems"):
        CodeTaskConfig(min_steps=1, max_steps=1, max_constant=3, num_train=100)
    with pytest.raises(ValueError, match="min_steps"):
        CodeTaskConfig(min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="max_constant"):  # constants are written as words, two to nine
        CodeTaskConfig(max_constant=10)
    with pytest.raises(ValueError, match="max_steps"):  # longer ones outgrow the tiny model
        CodeTaskConfig(max_steps=9)
