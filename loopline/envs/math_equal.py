"""Math answers: the final answer of a response, and whether it equals the reference mathematically.

`final_answer` takes the last `\\boxed{...}`, else what follows "answer is", else the last number. `equivalent`
turns both sides from the LaTeX people write (\\frac, \\sqrt, \\cdot, ^, \\pi, \\left( ...) into sympy
expressions and checks that their difference simplifies to 0; tuples ("1, 2") compare element by element.

Model output is hostile input: sympy's parser evaluates Python, so only a small grammar reaches it (digits,
operators, parentheses, single-letter symbols, sqrt and pi), at most MAX_CHARS characters, with small
exponents and numbers (no 9^9^9^9). Anything else is not equal to anything. A pathological expression that makes simplify slow is the env pool's task timeout's
problem: the worker is replaced and the chunk retried (envs.pool).
"""

from __future__ import annotations

import re

MAX_CHARS = 200
_ALLOWED = re.compile(r"^[0-9a-z+\-*/^()., ]*$")
_WORDS = re.compile(r"[a-z]{2,}")
_KNOWN_WORDS = {"sqrt", "pi"}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
MAX_EXPONENT = 64


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the {...} group opening at text[start] (nested braces counted), and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    return None


def final_answer(response: str) -> str:
    """The answer a response gives: its last \\boxed{...}, else the text after its last 'answer is', else its
    last number; "" when it gives none."""
    boxed = response.rfind("\\boxed")
    if boxed >= 0:
        group = _braced(response, boxed + len("\\boxed"))
        if group is not None:
            return group[0].strip()
    lowered = response.lower()
    said = lowered.rfind("answer is")
    if said >= 0:
        rest = response[said + len("answer is") :].strip().lstrip(":").strip()
        return rest.split("\n", 1)[0].rstrip(". ").strip("$ ")
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else ""


def _frac(text: str, name: str) -> str:
    """\\frac{a}{b} (and \\dfrac, \\tfrac) -> ((a)/(b)), innermost first."""
    while True:
        at = text.find(name)
        if at < 0:
            return text
        top = _braced(text, at + len(name))
        bottom = _braced(text, top[1]) if top else None
        if top is None or bottom is None:
            return text[:at] + "?" + text[at + len(name) :]  # malformed: never parses
        text = text[:at] + f"(({top[0]})/({bottom[0]}))" + text[bottom[1] :]


def normalise(answer: str) -> str:
    """LaTeX-ish answer text -> the small grammar sympy is given (may still fail to parse)."""
    s = answer.strip().strip("$").strip()
    s = re.sub(r"\\text\{[^{}]*\}", "", s)  # units and words
    s = re.sub(r"\\(left|right|,|!|;|:|displaystyle)", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\cdot", "*").replace("\\times", "*")
    s = re.sub(r"\\[dt]?frac(\d)(\d)", r"((\1)/(\2))", s)  # \frac12
    for name in ("\\dfrac", "\\tfrac", "\\frac"):
        s = _frac(s, name)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("{", "(").replace("}", ")").replace("\\", " ")
    return s.replace(" ", "").replace("**", "^").lower()


def _parse(text: str):  # -> sympy.Expr | None
    if not text or len(text) > MAX_CHARS or not _ALLOWED.match(text):
        return None
    if any(word not in _KNOWN_WORDS for word in _WORDS.findall(text)) or re.search(r"\.[a-z_]", text):
        return None  # only single-letter symbols and sqrt/pi: no attribute access, no other names
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = (*standard_transformations, implicit_multiplication_application, convert_xor)
    try:
        tree = parse_expr(text, transformations=transformations, evaluate=False)
        return tree.doit() if _small_powers(tree) else None
    except Exception:  # any parse failure: not an expression
        return None


def _small_powers(tree) -> bool:  # noqa: ANN001 (a sympy expression)
    """Every numeric exponent, nested ones included, is at most MAX_EXPONENT: 9^9^9^9 is never computed."""
    import sympy

    for power in tree.atoms(sympy.Pow):
        exponent = power.exp
        if not exponent.free_symbols and abs(complex(exponent.evalf(5))) > MAX_EXPONENT:
            return False
    return True


def _equal_values(a: str, b: str) -> bool:
    import sympy

    x, y = _parse(a), _parse(b)
    if x is None or y is None:
        return False
    try:
        difference = sympy.simplify(x - y)
        return bool(difference == 0) or (difference.is_number and abs(complex(difference)) < 1e-9)
    except Exception:  # e.g. a tuple minus a number
        return False


def _parts(text: str) -> list[str]:
    """The elements of a tuple answer ("(1,2)", "1,2"), split at top-level commas; [text] for one value."""
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        return [text.replace(",", "")]  # a thousands separator, not a tuple
    if text.startswith("(") and text.endswith(")"):
        depth = 0
        for i, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and i < len(text) - 1:
                break  # the first "(" closes before the end: not one wrapping pair
        else:
            text = text[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def equivalent(response_answer: str, reference: str) -> bool:
    """Whether two answers are mathematically equal (same text after normalising, or a zero difference;
    tuples element by element, in order)."""
    a, b = normalise(response_answer), normalise(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    parts_a, parts_b = _parts(a), _parts(b)
    if len(parts_a) != len(parts_b):
        return False
    return all(p == q or _equal_values(p, q) for p, q in zip(parts_a, parts_b, strict=True))


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals `answer` mathematically, else 0.0."""
    return 1.0 if equivalent(final_answer(response), answer) else 0.0
