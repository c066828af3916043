"""`loopline bench env`: how fast the RL loop's env steps a step's episodes, on env workers vs in the controller.

Two workloads, each run the same way `--rounds` times after a warm-up (workers started, warm sandboxes up):
- code checks: a GRPO step's scoring with env.name=code: `--completions` HumanEval-form completions (a function
  each, four asserts in its check, a quarter of them wrong), every check run in the sandbox behind the judge;
- tool calls: `--episodes` calculator episodes stepped as the multi-turn driver's last turn sends them (each
  replays its tool call, then scores the answer; envs.episodes.step_chunk): one calculator call per episode.
Each in two ways:
- inprocess: envs.episodes' functions in this process (what a loop without env workers would do: the
  episodes still run side by side, in threads);
- workers_N: `runtime.scorer.ScorerRole` on N local env worker processes (the local backend's scorer), for
  each N of `--workers`.
Prints `name: value` lines (per second, and the results agree), ending with the headline: code checks, the most
workers over in-process. On 2 cores, in-process threads already keep both cores busy with sandboxes; the workers'
gain is the controller they leave free and, on Ray, the nodes they add. A tool call takes microseconds: a round is
one task per worker, so its round trip is paid once per worker, and the workers step their shares in parallel.
"""

from __future__ import annotations

import argparse
import time

from loopline.data.rows import PromptRow
from loopline.envs.config import CalculatorConfig, EnvConfig
from loopline.envs.episodes import Histories, score_chunk, step_chunk
from loopline.envs.tasks import calculator_splits, demonstration


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


def tool_episodes(n: int) -> Histories:
    """n calculator episodes at their last turn: the tool call, then the right answer."""
    rows, _ = calculator_splits(CalculatorConfig(num_train=n, num_eval=1, num_val=0), seed=0)
    return Histories(rows, [demonstration(row, use_tool=True) for row in rows])


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
    parser.add_argument(
        "--episodes", type=int, default=256, help="calculator episodes stepped per round (tool calls)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="env worker counts to try")
    args = parser.parse_args(argv)
    if args.completions < 1 or args.episodes < 1 or args.rounds < 1 or min(args.workers) < 1:
        parser.error("--completions, --episodes, --rounds and every --workers count must be >= 1")

    from loopline.runtime.scorer import ScorerRole

    env, calc = EnvConfig(name="code"), EnvConfig(name="calculator")
    texts, rows = batch(args.completions)
    tools = tool_episodes(args.episodes)
    print(f"completions: {len(texts)}")
    print(f"episodes: {len(tools.rows)}")
    print(f"rounds: {args.rounds}")
    inprocess, want = _rate(
        lambda t, r: [v.reward for v in score_chunk(env, (t, r))], texts, rows, args.rounds
    )
    print(f"inprocess.checks_per_s: {inprocess:.1f}")
    print(f"inprocess.reward_mean: {sum(want) / len(want):.4f}")
    calls, want_tools = _rate(
        lambda r, a: [s.reward for s in step_chunk(calc, Histories(r, a))],
        tools.rows,
        tools.actions,
        args.rounds,
    )
    print(f"inprocess.tool_calls_per_s: {calls:.1f}")
    print(f"inprocess.tool_reward_mean: {sum(want_tools) / len(want_tools):.4f}")
    rate = inprocess
    for n in args.workers:
        scorer, stepper = ScorerRole(env, workers=n), ScorerRole(calc, workers=n)
        try:
            rate, got = _rate(lambda t, r, s=scorer: s.score(t, r).rewards.tolist(), texts, rows, args.rounds)
            calls, got_tools = _rate(
                lambda r, a, s=stepper: [x.reward for x in s.step(r, a)],
                tools.rows,
                tools.actions,
                args.rounds,
            )
        finally:
            scorer.close()
            stepper.close()
        print(f"workers_{n}.checks_per_s: {rate:.1f}")
        print(f"workers_{n}.same_rewards: {int(got == want)}")
        print(f"workers_{n}.tool_calls_per_s: {calls:.1f}")
        print(f"workers_{n}.same_tool_rewards: {int(got_tools == want_tools)}")
    print(f"workers_{args.workers[-1]}_over_inprocess.checks_per_s: {rate / inprocess:.2f}")
    return 0
