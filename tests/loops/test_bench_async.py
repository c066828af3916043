"""`loopline bench async`'s runs for one seed, on a tiny job on the session's Ray: an SFT warm start, then the
same GRPO job synchronous and with max_staleness 2 and partial rollouts from its weights, each mode's figures from
its rows; and the long-tail workload's data."""

from __future__ import annotations

import importlib
import json
import statistics
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


@pytest.mark.heavy
@pytest.mark.slow
def test_one_seeds_runs_report_each_mode(ray_cluster, tmp_path: Path) -> None:
    import ray

    workload = [*TINY, f"runtime.cluster.address={ray.get_runtime_context().gcs_address}"]
    # the modes differ in their config only (the fixed schedule's staleness: tests/loops/test_async_rl.py)
    modes = ["sync", "k2_partial"]
    result = bench.run_seed(tmp_path, workload, seed=0, steps=3, timeout_s=300, modes=modes)
    assert list(result) == modes
    for mode in modes:
        r = result[mode]
        assert r["samples_per_s"] > 0 and 0 <= r["eval_accuracy"] <= 1
        assert r["start_accuracy"] == result["sync"]["start_accuracy"]  # all from one warm start
    r = result["k2_partial"]
    assert r["staleness_max"] <= 2 and r["stale_dropped"] == 0 and 0 <= r["partial_fraction"] <= 1
    assert "staleness_mean" not in result["sync"]
    # the picture of the runs' timelines
    png = plot_timeline({m: tmp_path / f"{m}-0" / "trace.json" for m in modes}, tmp_path / "t.png")
    assert png.stat().st_size > 5000


def test_the_long_tail_workload_has_a_long_tail_and_a_disjoint_held_out_split(tmp_path: Path) -> None:
    train, held_out = bench.longtail_rows(seed=0)
    lengths = sorted(len(r["answer"]) for r in train)
    assert statistics.median(lengths) <= 16 and lengths[-1] == bench.LONGTAIL_MAX  # a few tokens, and a tail
    assert 0.05 < sum(n > 60 for n in lengths) / len(lengths) < 0.2
    assert statistics.median(len(r["answer"]) for r in held_out) <= 12
    for r in train[:50] + held_out:
        start, n = r["prompt"][0], int(r["prompt"][2:-1])
        assert len(r["answer"]) == n and r["answer"][0] == start and r["completion"] == r["answer"] + "\n"
        chars = bench.LONGTAIL_CHARS
        assert all(
            chars[(chars.index(a) + 1) % len(chars)] == b for a, b in zip(r["answer"], r["answer"][1:])
        )
    prompts = [r["prompt"] for r in held_out]
    assert len(set(prompts)) == len(prompts) == 512 and not set(prompts) & {r["prompt"] for r in train}
    assert bench.longtail_rows(seed=1) != (train, held_out)
    # the command line points at the seed's files, which hold those rows
    args = bench.workload_args("longtail", tmp_path, seed=0)
    path = Path(next(a for a in args if a.startswith("data.eval_path=")).split("=", 1)[1])
    assert [json.loads(line) for line in path.read_text().splitlines()] == held_out
