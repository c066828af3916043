"""The math env's checker: final-answer extraction, equivalence on pairs people write, and hostile text."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopline.envs.math_equal import MAX_CHARS, equivalent, final_answer, math_reward

EQUAL = [
    ("1/2", "0.5"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{6}", "\\frac12"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("1,000", "1000"),
    ("(1, 2)", "1,2"),
    ("\\pi/2", "\\frac{\\pi}{2}"),
    ("5\\text{ cm}", "5"),
    ("50\\%", "50"),
    ("-3", "-3.0"),
    ("\\left(3\\right)", "3"),
    ("2\\cdot 3", "6"),
    ("x^(1/2)", "\\sqrt{x}"),
    ("10^{-3}", "0.001"),
    ("$\\frac{\\sqrt{3}}{2}$", "\\sqrt{3}/2"),
]
NOT_EQUAL = [
    ("1/3", "0.33"),
    ("2", "3"),
    ("(1,2)", "(2,1)"),  # tuples are ordered
    ("1,2", "3"),
    ("x+1", "x"),
    ("\\frac{1}{2", "0.5"),  # malformed
    ("", "0"),
    ("1,000", "1"),
]


@pytest.mark.parametrize(("a", "b"), EQUAL)
def test_equal_pairs(a: str, b: str) -> None:
    assert equivalent(a, b) and equivalent(b, a)


@pytest.mark.parametrize(("a", "b"), NOT_EQUAL)
def test_unequal_pairs(a: str, b: str) -> None:
    assert not equivalent(a, b) and not equivalent(b, a)


def test_final_answer_takes_the_last_boxed_then_answer_is_then_the_last_number() -> None:
    assert final_answer("so \\boxed{2} no wait \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert final_answer("\\boxed{\\sqrt{x^{2}}}") == "\\sqrt{x^{2}}"  # nested braces
    assert final_answer("The answer is: 42.") == "42"
    assert final_answer("3 apples and 7 pears") == "7"
    assert final_answer("no digits here") == ""
    assert math_reward("so it is \\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_reward("so it is \\boxed{0.6}", "\\frac{1}{2}") == 0.0


@pytest.mark.parametrize(
    "hostile",
    [
        "__import__('os').system('touch /tmp/loopline-pwned')",
        "a.__class__",
        "x.real",
        "exec(1)",
        "lambda: 1",
        "9^9^9^9",
        "2**99999999",
        "x^(9^9^9)",
        "1" * (MAX_CHARS + 1),
    ],
)
def test_hostile_answers_are_not_evaluated(hostile: str) -> None:
    # refused before sympy evaluates or computes anything (if not, the power towers hang: pytest-timeout)
    assert not equivalent(hostile, "1")
    assert not Path("/tmp/loopline-pwned").exists()
