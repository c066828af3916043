"""`loopline bench env`: how fast the RL loop's env scores a step's completions, on env workers vs in the controller.

The workload is a GRPO step's scoring with env.name=code: `--completions` HumanEval-form completions (a function
each, four asserts in its check, a quarter of them wrong), every check run in the sandbox behind the judge. Each
way scores the same batch `--rounds` times after a warm-up (workers started, warm sandboxes up):
- inprocess: `envs.episodes.score_chunk` in this process (what a loop without env workers would do: the
  episodes still run side by side, in threads);
- workers_N: `runtime.scorer.ScorerRole` on N local env worker processes (the local backend's scorer), for
  each N of `--workers`.
Prints `name: value` lines (checks per second, and the rewards agree), ending with the headline: the most workers
over in-process. On 2 cores, in-process threads already keep both cores busy with sandboxes; the workers' gain
is the controller they leave free and, on Ray, the nodes they add.
"""

from __future__ import annotations

import argparse
import time

from loopline.data.rows import PromptRow
from loopline.envs.config import EnvConfig
from loopline.envs.episodes import score_chunk


def batch(n: int) -> tuple[list[str], list[PromptRow]]:
    """n completions of `def f(x)` that should return x + k, one in four off by one, with their rows."""
    texts, rows = [], []
    for i in range(n):
        k = i % 10
        test = "def check(candidate):\n" + "".join(
            f"    assert candidate({x}) == {x + k}\n" for x in (0, 1, 5, -3)
        )
        rows.append(PromptRow(index=i, prompt="def f(x):\n", extra=(("entry_point", "f"), ("test", test))))
        texts.append(f"    return x + {k + (i % 4 == 3)}\n")
    return texts, rows


def _rate(score, texts: list[str], rows: list[PromptRow], rounds: int) -> tuple[float, list[float]]:
    """(checks per second over `rounds` scorings after one warm-up, the rewards)."""
    rewards = list(score(texts, rows))
    start = time.perf_counter()
    for _ in range(rounds):
        score(texts, rows)
    return rounds * len(texts) / (time.perf_counter() - start), [float(r) for r in rewards]


def main(argv: list[str]) -> int:
    """Entry point of `loopline bench env`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="loopline bench env", description=__doc__, allow_abbrev=False)
    parser.add_argument(
        "--completions", type=int, default=64, help="completions scored per round (a step's batch)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="env worker counts to try")
    args = parser.parse_args(argv)
    if args.completions < 1 or args.rounds < 1 or min(args.workers) < 1:
        parser.error("--completions, --rounds and every --workers count must be >= 1")

    from loopline.runtime.scorer import ScorerRole

    env = EnvConfig(name="code")
    texts, rows = batch(args.completions)
    print(f"completions: {len(texts)}")
    print(f"rounds: {args.rounds}")
    inprocess, want = _rate(lambda t, r: score_chunk(env, (t, r)), texts, rows, args.rounds)
    print(f"inprocess.checks_per_s: {inprocess:.1f}")
    print(f"inprocess.reward_mean: {sum(want) / len(want):.4f}")
    rate = inprocess
    for n in args.workers:
        scorer = ScorerRole(env, workers=n)
        try:
            rate, got = _rate(lambda t, r, s=scorer: s.score(t, r).tolist(), texts, rows, args.rounds)
        finally:
            scorer.close()
        print(f"workers_{n}.checks_per_s: {rate:.1f}")
        print(f"workers_{n}.same_rewards: {int(got == want)}")
    print(f"workers_{args.workers[-1]}_over_inprocess.checks_per_s: {rate / inprocess:.2f}")
    return 0
