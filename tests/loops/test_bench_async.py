"""`loopline bench async`'s runs for one seed, on a tiny job on the session's Ray: an SFT warm start, then the
same GRPO job synchronous and with max_staleness 1 and 2 from its weights, each mode's figures from its rows."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from loopline.metrics.trace import plot_timeline

bench = importlib.import_module("loopline.bench.async")  # `async` is a keyword: not importable by name

TINY = [
    "train", "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.stop_at_accuracy=null",
    "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=16", "grpo.eval_every=0",
    "grpo.entropy_coef=0.01", "data.task.num_train=40", "data.task.num_eval=8", "eval.num_prompts=8",
    "threads=1", "runtime.call_timeout_s=120",
]  # fmt: skip


@pytest.mark.slow
def test_one_seeds_runs_report_each_mode(ray_cluster, tmp_path: Path) -> None:
    import ray

    workload = [*TINY, f"runtime.cluster.address={ray.get_runtime_context().gcs_address}"]
    modes = ["sync", "k1", "k2_partial"]  # the fixed schedule and partial rollouts; k2 is k1's path
    result = bench.run_seed(tmp_path, workload, seed=0, steps=3, timeout_s=300, modes=modes)
    assert list(result) == modes
    for mode in modes:
        (k, partial), r = bench.MODES[mode], result[mode]
        assert r["samples_per_s"] > 0 and 0 <= r["eval_accuracy"] <= 1
        assert r["start_accuracy"] == result["sync"]["start_accuracy"]  # all from one warm start
        if k and partial == "none":  # the fixed schedule: exactly k behind after the first k steps
            assert r["staleness_max"] == k and r["stale_dropped"] == 0 and r["partial_fraction"] == 0
            assert 0 < r["staleness_mean"] <= k  # the first k batches are fresher
        elif k:
            assert r["staleness_max"] <= k and r["stale_dropped"] == 0 and 0 <= r["partial_fraction"] <= 1
    # the picture of the first runs' timelines
    png = plot_timeline({m: tmp_path / f"{m}-0" / "trace.json" for m in ("sync", "k1")}, tmp_path / "t.png")
    assert png.stat().st_size > 5000
