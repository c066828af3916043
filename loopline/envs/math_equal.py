"""Math answers: the final answer of a response, and whether it equals the reference mathematically.

`extract` finds the answer a response gives, by the first of these rules that applies (docs/guide/math-reward.md):

1. boxed: the content of the last `\\boxed{...}` (nested braces counted);
2. answer is: the text after the last "answer is" (any case), to the end of its line, without a leading ':',
   trailing '.', ' ' or '$'; when that is not one answer (`5 apples`, `x = 5`, `\\frac{5}{3}, about 1.67`), the
   first complete expression in it (as rule 3 finds them);
3. last expression: the last complete mathematical expression in the text (last_expression: scanned left to
   right, the longest at each position): a fraction `\\frac{a}{b}` (`\\dfrac`, `\\tfrac`, `\\frac12`), a root
   `\\sqrt{a}` with an optional numeric factor (`2\\sqrt{3}`), a number with thousands separators (`1,000`),
   a ratio `a/b`, a decimal or an integer; each with a '-' sign when the character before the '-' (spaces
   skipped) is not a digit, letter or closing bracket (`x = -3` is -3, `5-3` is 3). A response that ends inside
   a `\\frac` or `\\sqrt` (one of its braces opened and never closed, or nothing after it: cut at
   max_new_tokens) gives no answer: a guess from the digits before the cut would score the wrong number.

No rule applies: no answer, and `extract` says why (Extraction.reason); it equals nothing.

`equivalent` turns both sides from the LaTeX people write (\\frac, \\sqrt, \\cdot, ^, \\pi, \\left( ...) into sympy
expressions and checks that their difference simplifies to 0; tuples ("1, 2") compare element by element.

Model output is hostile input: sympy's parser evaluates Python, so only a small grammar reaches it (digits,
operators, parentheses, single-letter symbols, sqrt and pi), at most MAX_CHARS characters, with small
exponents and numbers (no 9^9^9^9). Anything else is not equal to anything. A pathological expression that makes
simplify slow is the env pool's task timeout's problem: the worker is replaced and the chunk retried (envs.pool).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_CHARS = 200
_ALLOWED = re.compile(r"^[0-9a-z+\-*/^()., ]*$")
_WORDS = re.compile(r"[a-z]{2,}")
_KNOWN_WORDS = {"sqrt", "pi"}
MAX_EXPONENT = 64
# The numbers of the last-expression rule: thousands first (1,000 is one number), then a ratio, a decimal, an integer.
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d|,\d)|\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|\.\d+")
_FRACTION = re.compile(r"\\[dt]?frac")
_OPENERS = re.compile(r"\\(?:[dt]?frac|sqrt)")
_SIGN_AFTER = re.compile(
    r"[0-9A-Za-z)\]}]"
)  # a '-' after one of these is a minus between two terms, not a sign


@dataclass(frozen=True)
class Extraction:
    """The answer a response gives (text, "" for none), the rule that found it, and why none was found."""

    text: str
    rule: str  # "boxed", "answer is", "last expression" or "none"
    reason: str = ""  # rule "none": why no answer was taken


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


def _atom_end(text: str, at: int) -> int | None:
    """The end of the unsigned expression starting at text[at] (a fraction, a root with an optional numeric
    factor, or a number), or None when none starts there."""
    fraction = _FRACTION.match(text, at)
    if fraction:
        end = fraction.end()
        if re.match(r"\d\d", text[end : end + 2]):  # \frac12
            return end + 2
        top = _braced(text, end)
        bottom = _braced(text, top[1]) if top else None
        return bottom[1] if bottom else None
    number = _NUMBER.match(text, at)
    end = number.end() if number else at
    if text.startswith("\\sqrt", end):  # a root, with the number before it as its factor
        after = end + len("\\sqrt")
        if after < len(text) and text[after].isdigit():  # \sqrt2
            return after + 1
        group = _braced(text, after)
        return group[1] if group else None
    return end if number else None


def _is_sign(text: str, at: int) -> bool:
    before = text[:at].rstrip()
    return text[at] == "-" and not (before and _SIGN_AFTER.match(before[-1]))


def last_expression(text: str) -> tuple[str, str]:
    """The last complete mathematical expression of `text` (rule 3 of the module's docstring) and "", or "" and
    the reason there is none."""
    unfinished = _unfinished(text)
    if unfinished:
        return "", f"it ends inside an unfinished {unfinished} (cut short?)"
    found = _expressions(text)
    return (found[-1], "") if found else ("", "it holds no number, fraction or root")


def _expressions(text: str) -> list[str]:
    """The complete mathematical expressions of `text`, left to right, the longest at each position."""
    found, i = [], 0
    while i < len(text):
        start = i + 1 if _is_sign(text, i) else i
        end = _atom_end(text, start)
        if end is None:
            i += 1
            continue
        found.append(text[i:end])
        i = end
    return found


def _one_answer(text: str) -> bool:
    """Whether `text` is one answer the equivalence check reads (a value, an expression or a tuple of them), not
    a sentence or an equation."""
    parts = _parts(normalise(text))
    return all(_parse(part) is not None for part in parts)


def _unfinished(text: str) -> str | None:
    """The \\frac or \\sqrt that `text` ends inside (one of its groups opens and never closes, or nothing follows
    it), or None."""
    for opener in _OPENERS.finditer(text):
        at = opener.end()
        for _ in range(2 if "frac" in opener.group() else 1):
            if not text[at:].strip():
                return opener.group()
            group = _braced(text, at)
            if group is None:
                if text[at] == "{":  # opened, never closed: the text ends inside it
                    return opener.group()
                break
            at = group[1]
    return None


def extract(response: str) -> Extraction:
    """The answer `response` gives, by the first rule of the module's docstring that applies."""
    boxed = response.rfind("\\boxed")
    if boxed >= 0:
        group = _braced(response, boxed + len("\\boxed"))
        if group is not None:
            return Extraction(group[0].strip(), "boxed")
    said = response.lower().rfind("answer is")
    if said >= 0:
        rest = response[said + len("answer is") :].strip().lstrip(":").strip()
        said_text = rest.split("\n", 1)[0].rstrip(". ").strip("$ ")
        if said_text and not _one_answer(said_text) and _expressions(said_text):
            return Extraction(_expressions(said_text)[0], "answer is")  # "5 apples", "x = 5, since ..."
        return Extraction(said_text, "answer is")
    text, reason = last_expression(response)
    return Extraction(text, "last expression") if text else Extraction("", "none", reason)


def final_answer(response: str) -> str:
    """The answer a response gives (extract's text): "" when it gives none."""
    return extract(response).text


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
