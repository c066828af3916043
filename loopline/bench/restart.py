"""`loopline bench restart`: how soon a run trains again after a restart, and what checkpoints cost the loop.

1. Time to the first train step, fresh vs resumed. `loopline train` is started as a new process, as a
   scheduler restarts a job: fresh, and with --resume from a checkpoint at GRPO step K. Each is timed
   from process start to the end of the first GRPO step it trains (its metrics row is written; the
   LOOPLINE_PAUSE_AT hook marks that moment, then the process is killed). SFT is off so both runs
   train the same kind of step; the fresh run also runs its small step-0 eval. Median of --repeats.
2. Checkpoint save time, blocking vs async, in this process: the policy of each of --models with its
   AdamW state, saved by the Checkpointer as `loopline train` saves (DCP shards + HF weights). Blocking:
   how long save() holds the loop. Async: how long save() holds the loop (copying the state), and how
   long until the checkpoint is whole and `latest`; plus a train step's time alone and while an async
   write runs (on few cores the writer competes with the step for CPU).

Prints `name: value` lines, ending with the headline ratios: the loop's wait for an async save over a
blocking one, then resumed over fresh time to the first train step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loopline.bench.sync import BENCH_MODELS
from loopline.checkpoint.faults import PAUSE_DIR_ENV, PAUSE_ENV

RUN = [
    "sft.steps=0", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=16",
    "grpo.eval_every=0", "data.task.num_train=200", "data.task.num_eval=4", "eval.num_prompts=4",
    "progress=false", "tensorboard=false", "threads=1",
]  # fmt: skip


def _model_args(name: str) -> list[str]:
    return [f"model.tiny.{k}={v}" for k, v in BENCH_MODELS[name].items()]


def _time_to_step(run: Path, step: int, resume: bool, extra: list[str], timeout_s: float) -> float:
    """Seconds from starting `loopline train` to the end of GRPO step `step` (then the process is killed)."""
    markers = run.parent / f"markers-{run.name}"
    marker = markers / f"step_grpo_{step}.paused"
    marker.unlink(missing_ok=True)
    env = {**os.environ, PAUSE_ENV: f"step:grpo:{step}", PAUSE_DIR_ENV: str(markers)}
    cmd = [sys.executable, "-m", "loopline.cli", "train", *(["--resume"] if resume else []), *RUN, *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, f"out_dir={run}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        while not marker.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"loopline train ended (rc {proc.returncode}): {proc.stderr.read()[-2000:]!r}"
                )
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"loopline train did not reach GRPO step {step} within {timeout_s:.0f}s")
            time.sleep(0.01)
        return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait(30)
        proc.stderr.close()


def bench_restart(
    tmp: Path, model: str, resume_step: int, repeats: int, timeout_s: float
) -> dict[str, float]:
    """Median time to the first train step of a fresh run and of a run resumed at GRPO step resume_step."""
    extra = _model_args(model)
    base = tmp / "base"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopline.cli",
            "train",
            *RUN,
            *extra,
            f"grpo.steps={resume_step}",
            f"out_dir={base}",
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )  # the checkpoint to resume from
    if done.returncode != 0:
        raise RuntimeError(f"making the checkpoint failed: {done.stderr[-2000:]}")
    more = [*extra, f"grpo.steps={resume_step + 10}", "checkpoint_every=1000"]  # no save before the mark
    fresh, resumed = [], []
    for i in range(repeats):
        fresh.append(_time_to_step(tmp / f"fresh-{i}", 1, False, more, timeout_s))
        run = tmp / f"resumed-{i}"
        shutil.copytree(base, run)
        resumed.append(_time_to_step(run, resume_step + 1, True, more, timeout_s))
    return {"fresh_s": statistics.median(fresh), "resumed_s": statistics.median(resumed)}


def bench_save(tmp: Path, model_name: str, repeats: int) -> dict[str, float]:
    """Blocking and async checkpoint saves of `model_name` with its AdamW state, as the train loop saves."""
    from loopline.checkpoint.config import CheckpointConfig
    from loopline.checkpoint.state import Checkpointer, RunState
    from loopline.data.batches import collate
    from loopline.models.config import TinyModelConfig
    from loopline.models.load import build_tiny_model
    from loopline.models.tokenizer import build_byte_tokenizer
    from loopline.runtime.actor import local_actor
    from loopline.training.config import OptimConfig

    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(TinyModelConfig(**BENCH_MODELS[model_name]), tokenizer, seed=0)
    actor = local_actor(model)
    actor.start_phase(OptimConfig(lr=1e-4, warmup_steps=0), 1000, None)
    g = torch.Generator().manual_seed(0)
    batch = collate(
        [torch.randint(3, 259, (16,), generator=g).tolist() for _ in range(16)],
        [torch.randint(3, 259, (8,), generator=g).tolist() for _ in range(16)],
        tokenizer.pad_token_id,
    )

    def step() -> float:
        t0 = time.perf_counter()
        actor.sft_step(batch, micro_batch_size=16)
        return time.perf_counter() - t0

    step()  # AdamW state exists from here on: the checkpoint holds it
    out: dict[str, list[float]] = {
        k: [] for k in ("blocking", "async_blocked", "async_total", "step", "step_async")
    }
    for mode in ("blocking", "async"):
        checkpoints = Checkpointer(
            tmp / f"save-{model_name}-{mode}",
            CheckpointConfig(async_save=mode == "async", keep_last=1),
            actor,
            model,
            tokenizer,
        )
        for i in range(repeats):
            t0 = time.perf_counter()
            checkpoints.save(RunState("grpo", i + 1))
            blocked = time.perf_counter() - t0
            if mode == "blocking":
                out["blocking"].append(blocked)
                out["step"].append(step())
            else:
                out["async_blocked"].append(blocked)
                out["step_async"].append(step())  # while the write runs (it may be done already)
                checkpoints.wait()
                out["async_total"].append(time.perf_counter() - t0)
    size = _dir_bytes(tmp / f"save-{model_name}-blocking" / "checkpoints")
    result = {k: statistics.median(v) for k, v in out.items()}
    result["params"] = float(sum(p.numel() for p in model.parameters()))
    result["checkpoint_bytes"] = float(size)
    return result


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith(".t"))


def _timed(label: str, fn: Callable[[], dict[str, float]]) -> dict[str, float]:
    t0 = time.perf_counter()
    result = fn()
    print(f"{label}.bench_wall_s: {time.perf_counter() - t0:.1f}", flush=True)
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loopline bench restart", description=__doc__, allow_abbrev=False)
    parser.add_argument(
        "--models", default="builtin", help=f"save bench models, comma list of {sorted(BENCH_MODELS)}"
    )
    parser.add_argument("--restart-model", default="builtin", help="model of the restarted runs")
    parser.add_argument("--resume-step", type=int, default=2, help="GRPO step of the checkpoint resumed from")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs/saves per case (median reported)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is given up")
    parser.add_argument("--skip-restart", action="store_true", help="only the save bench")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the runs (threads=1): the writer thread and the step share the cores
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    print(f"cpus: {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="loopline-bench-restart-") as tmp_dir:
        tmp = Path(tmp_dir)
        saves = {}
        for name in models:
            r = _timed(f"save.{name}", lambda name=name: bench_save(tmp, name, args.repeats))
            saves[name] = r
            print(f"save.{name}.params: {int(r['params'])}")
            print(f"save.{name}.checkpoint_bytes: {int(r['checkpoint_bytes'])}")
            print(f"save.{name}.blocking.loop_blocked_s: {r['blocking']:.4f}")
            print(f"save.{name}.async.loop_blocked_s: {r['async_blocked']:.4f}")
            print(f"save.{name}.async.until_latest_s: {r['async_total']:.4f}")
            print(f"save.{name}.train_step_s: {r['step']:.4f}")
            print(f"save.{name}.train_step_during_async_write_s: {r['step_async']:.4f}")
        restart = None
        if not args.skip_restart:
            restart = _timed(
                "restart",
                lambda: bench_restart(tmp, args.restart_model, args.resume_step, args.repeats, args.timeout),
            )
            print(f"restart.model: {args.restart_model}")
            print(f"restart.fresh.time_to_first_step_s: {restart['fresh_s']:.2f}")
            print(f"restart.resumed.time_to_first_step_s: {restart['resumed_s']:.2f}")
    last = saves[models[-1]] if models else None
    if last is not None:
        print(f"headline.model: {models[-1]}")
        print(f"headline.async_over_blocking_loop_blocked: {last['async_blocked'] / last['blocking']:.3f}")
    if restart is not None:
        print(
            f"headline.resumed_over_fresh_time_to_first_step: {restart['resumed_s'] / restart['fresh_s']:.3f}"
        )
    return 0
