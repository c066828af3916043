"""`loopline bench async`: the same RL job synchronous, with grpo.max_staleness = 1 and 2 on the fixed schedule,
and with k = 2 and partial rollouts (`k2_partial`: weights synced at once, taken by the engines mid-batch), on Ray
with one trainer rank, one engine and one env worker: samples/s of each, held-out accuracy of each after the same
number of samples, how stale the trained samples were, how many were partial and how long each side waited; ends
with the headline `async_over_sync_samples_per_s` (the best async mode over synchronous).

Per seed: one SFT warm start (local backend), then the three GRPO runs from its weights (model.path), each on a
fresh local Ray, all three with grpo.behaviour_correction=tis (the same loss: only the schedule differs).
samples/s counts the steps after the first (the first has nothing to overlap with) from each row's time_step,
so Ray's start and the final eval are outside it. The workload (--workload): `agent` is the calculator agent
(multi-turn episodes of tool calls and answers, so generation and env steps are a large share of a step, as in
agentic RL); `longtail` a task whose answer lengths have a long tail, as reasoning lengths do in RL on real
models (`longtail_rows`: half the training answers take 15 tokens or fewer, one in eight more than 60, the longest
250, so a synchronous step waits for its longest sequence; trained packed, so the trainer pays for real tokens only);
`addition` the default job's task (short answers: the trainer's share dominates, so overlap gains little there).
The response lengths of each run are printed, to show the tail.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopline.bench.args import require_positive
from loopline.config import load_config
from loopline.metrics.logger import read_metrics

# the `loopline` command line of each workload, less seed, steps and out_dir
WORKLOADS = {
    # `loopline agent`: the example's settings, SFT stopped at a validation accuracy that leaves RL room
    "agent": [
        "agent", "sft.steps=600", "sft.stop_at_accuracy=0.5", "sft.check_every=10",
        "grpo.eval_every=0", "grpo.stop_at_accuracy=null", "env.calculator.num_eval=512", "eval.num_prompts=512",
    ],
    # the long-tail task (files written per seed, see workload_args); SFT stopped early to leave RL room
    "longtail": [
        "train", "data.source=jsonl", "sft.steps=150", "sft.stop_at_accuracy=null", "sft.eval_every=0",
        "grpo.prompts_per_step=32", "grpo.group_size=8", "grpo.micro_batch_size=64", "grpo.eval_every=0",
        "grpo.sampling.max_new_tokens=256", "grpo.stop_at_accuracy=null", "eval.sampling.max_new_tokens=256", "eval.num_prompts=512", "threads=1",
        "model.packing=true", "grpo.optim.lr=1e-4",
    ],
    # the default job's task and settings
    "addition": ["train", "grpo.eval_every=0", "grpo.stop_at_accuracy=null", "eval.num_prompts=1000"],
}  # fmt: skip
LONGTAIL_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits
LONGTAIL_MAX = 250  # the longest answer (tokens)


def longtail_rows(seed: int, num_train: int = 4000, num_eval: int = 512) -> tuple[list[dict], list[dict]]:
    """Rows of the long-tail task: 'k*5=' asks for the 5 characters from k on ('klmno', cycling through a-z A-Z
    0-9). The count n follows a Pareto tail (x_min 4, alpha 1, capped at LONGTAIL_MAX). The held-out (start, n)
    pairs are drawn first, distinct; training rows (which may repeat) leave them out, which thins the short answers
    there: training median 14-15 tokens, mean 31-33, 11-13% over 60, 2-3% at the cap; held-out median 9-10, mean
    23-26 (seeds 0-2)."""
    rng = random.Random(f"longtail-{seed}")
    size = len(LONGTAIL_CHARS)

    def draw() -> tuple[int, int]:
        return rng.randrange(size), min(LONGTAIL_MAX, int(4 / (1 - rng.random())))

    def row(start: int, n: int) -> dict:
        text = "".join(LONGTAIL_CHARS[(start + i) % size] for i in range(n))
        return {"prompt": f"{LONGTAIL_CHARS[start]}*{n}=", "answer": text, "completion": text + "\n"}

    held_out: set[tuple[int, int]] = set()
    while len(held_out) < num_eval:
        held_out.add(draw())
    train: list[tuple[int, int]] = []
    while len(train) < num_train:
        pair = draw()
        if pair not in held_out:
            train.append(pair)
    return [row(*p) for p in train], [row(*p) for p in sorted(held_out)]


def workload_args(name: str, tmp: Path, seed: int) -> list[str]:
    """WORKLOADS[name] with the seed's data files written under tmp where the workload needs them."""
    if name != "longtail":
        return WORKLOADS[name]
    paths = []
    for split, rows in zip(("train", "eval"), longtail_rows(seed)):
        path = tmp / f"longtail-{seed}-{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return [*WORKLOADS[name], f"data.train_path={paths[0]}", f"data.eval_path={paths[1]}"]


# mode -> (grpo.max_staleness, grpo.partial_rollouts)
MODES = {"sync": (0, "none"), "k1": (1, "none"), "k2": (2, "none"), "k2_partial": (2, "recompute_kv")}


def _run(args: list[str], log: Path, timeout_s: float) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "loopline.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        raise RuntimeError(f"loopline {' '.join(args)} failed (rc {done.returncode}); see {log}")


def run_seed(
    tmp: Path, workload: list[str], seed: int, steps: int, timeout_s: float, modes: list[str] | None = None
) -> dict[str, dict]:
    """SFT once, then GRPO in each of `modes` (default: all of MODES) from its weights; each mode's figures.
    workload: a `loopline` command line (WORKLOADS)."""
    sft = tmp / f"sft-{seed}"
    _run(
        [*workload, f"seed={seed}", "grpo.steps=0", "progress=false", f"out_dir={sft}"],
        tmp / f"sft-{seed}.log",
        timeout_s,
    )
    model = sft / "checkpoints" / (sft / "checkpoints" / "latest").read_text().strip() / "model"
    start = [r["eval_accuracy"] for r in read_metrics(sft) if "eval_accuracy" in r][-1]
    out = {}
    for mode in modes or list(MODES):
        k, partial = MODES[mode]
        run = tmp / f"{mode}-{seed}"
        args = [
            *workload, f"seed={seed}", f"model.path={model}", "sft.steps=0", f"grpo.steps={steps}",
            "runtime.backend=ray", "runtime.trainer_ranks=1", "runtime.engines=1", "runtime.env_workers=1",
            "grpo.behaviour_correction=tis", f"grpo.max_staleness={k}", f"grpo.partial_rollouts={partial}",
            "checkpoint_every=0",
            "progress=false", "tensorboard=false", f"out_dir={run}",
        ]  # fmt: skip
        started = time.perf_counter()
        _run(args, tmp / f"{mode}-{seed}.log", timeout_s)
        rows = [r for r in read_metrics(run) if r.get("phase") == "grpo" and r["step"] > 0]
        timed = rows[1:]  # the first step has nothing to overlap with
        grpo = load_config(run / "config.yaml").grpo
        samples = len(timed) * grpo.prompts_per_step * grpo.group_size
        result = {
            "samples_per_s": samples / sum(r["time_step"] for r in timed),
            "eval_accuracy": rows[-1]["eval_accuracy"],
            "run_s": time.perf_counter() - started,
            "response_len_mean": statistics.mean(r["response_len_mean"] for r in rows),
            "response_len_max": max(r["response_len_max"] for r in rows),
            "time_step_mean": statistics.mean(r["time_step"] for r in timed),
        }
        if k:
            result |= {
                key: statistics.mean(r[key] for r in timed)
                for key in (
                    "staleness_mean",
                    "trainer_idle_fraction",
                    "engine_idle_fraction",
                    "partial_fraction",
                )
            }
            result["staleness_max"] = max(r["staleness_max"] for r in rows)
            result["stale_dropped"] = sum(r["stale_dropped"] for r in rows)
        out[mode] = result | {"start_accuracy": start}
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loopline bench async", description=__doc__, allow_abbrev=False)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="agent", help="the job (see above)")
    parser.add_argument("--seeds", default="0", help="comma list of seeds (the accuracy target reads three)")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps of each run (same samples in each)")
    parser.add_argument(
        "--timeline", default="", help="write a PNG of the first seed's timelines of the first two modes here"
    )
    parser.add_argument(
        "--keep", default="", help="keep the runs in this directory (default: a temporary one)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a run is given up")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma list of modes, sync first (of {', '.join(MODES)})"
    )
    args = parser.parse_args(argv)
    require_positive(parser, args, "timeout")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be a comma list of integers (got {args.seeds!r})")
    if not seeds or args.steps < 3:
        parser.error("--seeds needs at least one seed and --steps at least 3")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(modes) < 2 or modes[0] != "sync":
        parser.error(
            f"--modes must start with sync and name at least one async mode of {', '.join(MODES)}"
            + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    print(f"cpus: {os.cpu_count()}")
    print(f"workload: {args.workload}")
    with tempfile.TemporaryDirectory(prefix="loopline-bench-async-") as tmp_dir:
        tmp = Path(args.keep) if args.keep else Path(tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        results = {}
        for seed in seeds:
            workload = workload_args(args.workload, tmp, seed)
            results[seed] = run_seed(tmp, workload, seed, args.steps, args.timeout, modes)
            for mode, r in results[seed].items():
                for key, value in r.items():
                    print(f"seed{seed}.{mode}.{key}: {value:.4g}", flush=True)
        if args.timeline:
            from loopline.metrics.trace import plot_timeline

            first = seeds[0]
            traces = {f"{mode} (seed {first})": tmp / f"{mode}-{first}" / "trace.json" for mode in modes[:2]}
            print(f"timeline: {plot_timeline(traces, args.timeline)}")
    mean = {
        mode: {
            key: statistics.mean(results[s][mode][key] for s in seeds)
            for key in ("samples_per_s", "eval_accuracy")
        }
        for mode in modes
    }
    for mode in modes:
        print(f"{mode}.samples_per_s: {mean[mode]['samples_per_s']:.2f}")
        print(f"{mode}.eval_accuracy_mean: {mean[mode]['eval_accuracy']:.4f}")
        if MODES[mode][0]:
            staleness = statistics.mean(results[s][mode]["staleness_mean"] for s in seeds)
            print(f"{mode}.staleness_mean: {staleness:.3f}")
    for mode in modes[1:]:
        print(
            f"{mode}_over_sync_samples_per_s: {mean[mode]['samples_per_s'] / mean['sync']['samples_per_s']:.3f}"
        )
        gap = 100 * (mean[mode]["eval_accuracy"] - mean["sync"]["eval_accuracy"])
        print(f"{mode}_minus_sync_accuracy_points: {gap:+.2f}")
    best = max(mean[mode]["samples_per_s"] for mode in modes[1:])
    print(f"async_over_sync_samples_per_s: {best / mean['sync']['samples_per_s']:.3f}")
    return 0
