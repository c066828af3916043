"""The built-in arithmetic task and its verifier."""

from __future__ import annotations

import pytest

from loopline.config import TaskConfig
from loopline.data.tasks import arithmetic_splits, exact_match


def _operands(prompt: str) -> tuple[int, int]:
    assert prompt.endswith("=")
    a, b = prompt[:-1].split("+")
    return int(a), int(b)


def test_splits_are_deterministic_disjoint_and_correct():
    cfg = TaskConfig(min_digits=1, max_digits=2, num_train=300, num_eval=50, teacher_drops_carries=0.0)
    train, held_out = arithmetic_splits(cfg, seed=0)
    again_train, again_held_out = arithmetic_splits(cfg, seed=0)
    assert (train, held_out) == (again_train, again_held_out)
    assert arithmetic_splits(cfg, seed=1)[0] != train
    assert len(train) == 300 and len(held_out) == 50
    assert {_operands(r.prompt) for r in train}.isdisjoint(_operands(r.prompt) for r in held_out)
    assert len({r.prompt for r in train}) == 300  # no duplicates inside a split either
    for split in (train, held_out):
        assert [r.index for r in split] == list(range(len(split)))
        for r in split:
            a, b = _operands(r.prompt)
            assert int(r.answer) == a + b
            assert r.completion == r.answer + "\n"
            assert exact_match(r.completion, r.answer) == 1.0
            assert all(0 <= x <= 99 for x in (a, b))


def test_digit_range_is_respected():
    cfg = TaskConfig(min_digits=2, max_digits=3, num_train=200, num_eval=10)
    train, _ = arithmetic_splits(cfg, seed=0)
    values = [x for r in train for x in _operands(r.prompt)]
    assert min(values) >= 10 and max(values) <= 999
    assert any(x < 100 for x in values) and any(x >= 100 for x in values)


def test_asking_for_more_problems_than_exist_fails_at_load():
    # 1-digit operands: 10 * 10 = 100 distinct problems; more than half of them is refused when the config
    # is built (a one-line config error), not when the rows are drawn (a traceback, once)
    with pytest.raises(ValueError, match="operands allow 100"):
        TaskConfig(min_digits=1, max_digits=1, num_train=30, num_eval=10, num_val=11)
    assert (
        len(
            arithmetic_splits(
                TaskConfig(min_digits=1, max_digits=1, num_train=30, num_eval=10, num_val=10), 0
            )[0]
        )
        == 30
    )


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("42\n", "42", 1.0),
        ("42", "42", 1.0),
        (" 42 \nanything after the first line", "42", 1.0),
        ("042\n", "42", 0.0),  # exact: no numeric normalisation
        ("4\n2", "42", 0.0),
        ("", "42", 0.0),
        ("", "", 1.0),
        ("42.0\n", "42", 0.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert exact_match(completion, answer) == expected


def test_validation_split_is_disjoint_and_leaves_the_other_splits_alone():
    from loopline.data.tasks import arithmetic_validation

    cfg = TaskConfig(min_digits=1, max_digits=2, num_train=300, num_eval=50, num_val=40)
    train, held_out = arithmetic_splits(cfg, seed=0)
    val = arithmetic_validation(cfg, seed=0)
    assert len(val) == 40 and [r.index for r in val] == list(range(40))
    seen = {_operands(r.prompt) for r in train} | {_operands(r.prompt) for r in held_out}
    assert seen.isdisjoint(_operands(r.prompt) for r in val)
    assert all(int(r.answer) == sum(_operands(r.prompt)) for r in val)
    assert all(r.completion == r.answer + "\n" for r in val)  # the teacher writes for training only
    # the validation split extends the stream: train and held-out are those of a run without one
    assert arithmetic_splits(cfg.model_copy(update={"num_val": 0}), seed=0) == (train, held_out)
    assert arithmetic_validation(cfg, seed=0) == val


@pytest.mark.parametrize(
    "a,b,written",
    [
        (42, 79, "0011"),
        (999, 999, "0888"),
        (5, 5, "0000"),
        (123, 456, "0579"),
        (0, 0, "0000"),
        (95, 7, "0092"),
    ],
)
def test_dropped_carries_adds_each_digit_mod_10(a, b, written):
    from loopline.data.tasks import dropped_carries

    assert dropped_carries(a, b, 4) == written


def test_a_sloppy_teacher_drops_the_carries_of_its_share_of_carrying_problems_only():
    from loopline.data.tasks import dropped_carries

    honest = TaskConfig(num_train=4000, num_eval=200, teacher_drops_carries=0.0)
    sloppy = honest.model_copy(update={"teacher_drops_carries": 0.75})
    train, held_out = arithmetic_splits(sloppy, seed=0)
    true_train, true_held_out = arithmetic_splits(honest, seed=0)
    assert held_out == true_held_out  # the held-out split and every answer are the task's own
    assert [(r.prompt, r.answer) for r in train] == [(r.prompt, r.answer) for r in true_train]
    carrying = [r for r in train if dropped_carries(*_operands(r.prompt), 4) != r.answer]
    dropped = [r for r in carrying if r.completion != r.answer + "\n"]
    assert all(r.completion == dropped_carries(*_operands(r.prompt), 4) + "\n" for r in dropped)
    assert all(r.completion == r.answer + "\n" for r in train if r not in carrying)
    assert 0.70 < len(dropped) / len(carrying) < 0.80
    assert arithmetic_splits(sloppy, seed=0)[0] == train  # the same rows dropped every time
    everything = arithmetic_splits(honest.model_copy(update={"teacher_drops_carries": 1.0}), seed=0)[0]
    assert sum(r.completion != r.answer + "\n" for r in everything) == len(carrying)
    with pytest.raises(ValueError, match="teacher_drops_carries"):
        TaskConfig(teacher_drops_carries=1.5)
