"""`loopline bench step`: where a GRPO step's time goes, and the framework's share of it.

Runs the default job's GRPO stage for a few steps in this process (the local backend, the built-in model from
its initial weights: no SFT, the timing does not depend on accuracy) and splits each step by the loop's own
stage timers (rollout, score, experience = log-probs and advantages, train, sync) from metrics.jsonl. The
framework's share is the part of a step spent outside model forward passes (any `forward` of the model
class, engine and trainer), backward passes (`Tensor.backward`) and optimizer steps (torch's global optimizer
hooks): Python bookkeeping, batching, sampling, scoring, copies. Prints `name: value` lines, ending with it.
"""

from __future__ import annotations

import argparse
import functools
import io
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from loopline.metrics.logger import read_metrics

STAGES = ("rollout", "score", "experience", "train", "sync")


class ComputeClock:
    """Seconds spent in model forwards, backwards and optimizer steps while installed (outermost calls only)."""

    def __init__(self) -> None:
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self._depth = 0

    def _timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps the signature: the engine reads forward's parameter names
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # a forward inside a backward (checkpointing) or nested model: counted once
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - t0
                self._depth -= 1

        return wrapper

    @contextmanager
    def installed(self, model_class: type) -> Iterator[ComputeClock]:
        forward, backward = model_class.forward, torch.Tensor.backward
        model_class.forward = self._timed("forward", forward)
        torch.Tensor.backward = self._timed("backward", backward)
        started: list[float] = []

        def pre(*_: Any) -> None:
            started.append(time.perf_counter())

        def post(*_: Any) -> None:
            self.seconds["optimizer"] += time.perf_counter() - started.pop()

        hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        try:
            yield self
        finally:
            model_class.forward, torch.Tensor.backward = forward, backward
            for h in hooks:
                h.remove()

    def total(self) -> float:
        return sum(self.seconds.values())


@contextmanager
def step_marks(clock: ComputeClock) -> Iterator[list[tuple[str, int, float, float]]]:
    """(phase, step, wall time, compute seconds) at each metrics row the loop logs: per-step deltas."""
    from loopline.metrics.logger import MetricsLogger

    marks: list[tuple[str, int, float, float]] = []
    log = MetricsLogger.log

    def marked(self: MetricsLogger, row: dict[str, Any]) -> None:
        marks.append((row.get("phase", ""), row.get("step", -1), time.perf_counter(), clock.total()))
        log(self, row)

    MetricsLogger.log = marked  # type: ignore[method-assign]
    try:
        yield marks
    finally:
        MetricsLogger.log = log  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loopline bench step", description=__doc__)
    parser.add_argument(
        "--steps",
        type=int,
        default=7,
        help="GRPO steps (the first, a warm-up, and the last, which evaluates, left out)",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for the job, e.g. grpo.group_size=16")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first step is a warm-up, the last evaluates)")

    from transformers import Qwen2ForCausalLM

    from loopline.commands import train

    with tempfile.TemporaryDirectory(prefix="loopline-bench-step-") as out:
        overrides = [
            "sft.steps=0", f"grpo.steps={args.steps}", "grpo.eval_every=0", "grpo.stop_at_accuracy=null", "checkpoint_every=0",
            "progress=false", "tensorboard=false", f"out_dir={out}", *args.overrides,
        ]  # fmt: skip
        clock = ComputeClock()
        job_output = (
            io.StringIO()
        )  # the job's own report (accuracies, paths) would break the name: value lines
        with clock.installed(Qwen2ForCausalLM), step_marks(clock) as marks, redirect_stdout(job_output):
            # `loopline train` as the CLI runs it (a new run in a fresh directory: no resume, nothing to overwrite)
            flags = argparse.Namespace(
                resume=False, overwrite=False, allow_config_change=False, restart_unsaved=False
            )
            status = train(None, overrides, flags)
        if status:
            print(job_output.getvalue())
            return status
        rows = [r for r in read_metrics(out) if r["phase"] == "grpo" and 1 < r["step"] < args.steps]
    # a step is the time from the previous step's row to its own; left out: the first (a warm-up) and the last
    # (the run's final held-out eval happens before its row)
    grpo = [(step, t, c) for phase, step, t, c in marks if phase == "grpo"]
    spans = [
        (t1 - t0, c1 - c0) for (_, t0, c0), (step, t1, c1) in zip(grpo, grpo[1:]) if 1 < step < args.steps
    ]
    step_s = statistics.mean(w for w, _ in spans)
    print(f"steps_measured: {len(spans)} (of {args.steps}; the first is a warm-up, the last evaluates)")
    for stage in STAGES:
        seconds = statistics.mean(r.get(f"time_{stage}", 0.0) for r in rows)
        print(f"{stage}_ms: {seconds * 1e3:.1f}  ({seconds / step_s:.1%} of a step)")
    print(f"step_ms: {step_s * 1e3:.1f}")
    print(
        f"model_compute_ms: {statistics.mean(c for _, c in spans) * 1e3:.1f}  (forwards, backwards, optimizer)"
    )
    print(f"framework_share: {1 - sum(c for _, c in spans) / sum(w for w, _ in spans):.1%}")
    return 0
