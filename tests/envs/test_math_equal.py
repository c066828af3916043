"""The math env's checker: final-answer extraction, equivalence on pairs people write, and hostile text."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopline.envs.math_equal import MAX_CHARS, Extraction, equivalent, extract, final_answer, math_reward

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


# The last-expression rule (no \boxed, no "answer is"): the whole fraction, not its denominator, and the forms the
# docs call equal (issue 39: `\frac{5}{3}` scored 0 against `\frac{5}{3}`, the fallback taking "3").
BARE = [
    ("so the result is \\frac{5}{3}", "\\frac{5}{3}"),
    ("we get \\frac{1}{2}", "0.5"),
    ("we get \\dfrac{1}{2}", "1/2"),
    ("we get \\tfrac{3}{4}.", "0.75"),
    ("x = -\\frac{1}{2}.", "-0.5"),  # a negative fraction, a trailing period
    ("so $\\frac{5}{3}$.", "\\frac{5}{3}"),  # $...$ wrapping
    ("so $-\\dfrac{7}{2}$", "-3.5"),
    ("the answer is 3/4.", "\\frac{3}{4}"),
    ("then x = 3/4", "0.75"),
    ("5-3=2", "2"),  # a minus between two terms is no sign
    ("x = -3", "-3"),
    ("in all 1,000 apples", "1000"),
    ("it is 2\\sqrt{2}", "\\sqrt{8}"),
    ("roughly 0.25", "\\frac14"),
    ("the ratio \\frac12", "0.5"),
]


@pytest.mark.parametrize(("response", "answer"), BARE)
def test_a_bare_final_expression_is_taken_whole(response: str, answer: str) -> None:
    assert math_reward(response, answer) == 1.0


def test_the_rule_that_found_the_answer_and_the_reason_when_none_did() -> None:
    assert extract("so \\boxed{3} or \\frac{1}{2}") == Extraction("3", "boxed")
    assert extract("The answer is: \\frac{1}{2}.") == Extraction("\\frac{1}{2}", "answer is")
    assert extract("x = -\\frac{5}{3}.") == Extraction("-\\frac{5}{3}", "last expression")
    assert extract("first \\frac{1}{2}, then 7") == Extraction("7", "last expression")
    assert extract("\\frac{1}{2} + \\frac{5}{3}") == Extraction("\\frac{5}{3}", "last expression")
    nothing = extract("no digits here")
    assert nothing.text == "" and nothing.rule == "none" and "no number" in nothing.reason


@pytest.mark.parametrize(
    "cut", ["so x = \\frac{5}{", "so x = \\frac{5}{3", "so x = \\frac", "so x = \\sqrt{2"]
)
def test_a_response_cut_inside_a_fraction_gives_no_answer_rather_than_a_guess(cut: str) -> None:
    # without the rule, "\\frac{5}{3" would give "3" (or "5"): a wrong number scored as the model's answer
    got = extract(cut)
    assert got.text == "" and got.rule == "none" and "unfinished" in got.reason
    assert math_reward(cut, "3") == 0.0 and math_reward(cut, "5") == 0.0


@pytest.mark.parametrize(
    ("response", "taken"),
    [
        ("The answer is 5 apples.", "5"),
        ("the answer is x = -5", "-5"),
        ("The answer is: \\frac{5}{3}, which is about 1.67", "\\frac{5}{3}"),  # the first, not the last
        ("the answer is x^2+1", "x^2+1"),  # one answer: as written
        ("the answer is (1, 2).", "(1, 2)"),
    ],
)
def test_answer_is_takes_the_first_expression_after_it_when_the_rest_is_not_one_answer(
    response: str, taken: str
) -> None:
    assert extract(response) == Extraction(taken, "answer is")


def test_the_last_expression_is_not_part_of_a_longer_one() -> None:
    assert final_answer("it costs 1,000") == "1,000"  # one number with its separator, not "000"
    assert final_answer("then 12/25.") == "12/25"
    assert final_answer("and 3.14.") == "3.14"
    assert math_reward("so \\frac{5}{3}", "3") == 0.0  # the denominator alone is not the answer
