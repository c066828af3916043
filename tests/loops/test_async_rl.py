"""Asynchronous RL (grpo.max_staleness = k): batches generated ahead while the trainer trains, on a fixed
schedule (batch b under policy version max(0, b - k)).

The stream is checked with real threads and a stand-in collect that records the weights it ran under; the loop on
a local Ray cluster: a k = 1 run SIGKILLed between a step's row and its checkpoint and resumed ends bitwise equal
to the uninterrupted one (the checkpoint holds the batch generated ahead), every sample trained once, every
sample at most k versions old, and generation overlapping training in the run's trace.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.cli import main
from loopline.config import ConfigError, load_config
from loopline.loops.context import write_scale_request
from loopline.loops.grpo import scale_between_batches
from loopline.loops.stream import RolloutStream, too_stale
from loopline.metrics.logger import read_metrics
from loopline.metrics.trace import read_spans
from tests.runs import kill_at, steady


class Engines:
    """Stand-in engines: the weights version they hold, and what each collect ran under and when."""

    def __init__(self) -> None:
        self.version = 0
        self.collected: dict[int, tuple[int, float, float]] = {}  # batch -> (version, start, end)
        self.busy = threading.Lock()

    def produce(self, b: int) -> int:
        assert self.busy.acquire(blocking=False), "two collects at once"
        start = time.perf_counter()
        time.sleep(0.03)
        self.collected[b] = (self.version, start, time.perf_counter())
        self.busy.release()
        return b

    def snapshot(self) -> int:
        """Stand-in for the sampler/generator state: how many batches were collected."""
        return len(self.collected)


def _train(stream: RolloutStream[int], engines: Engines, first: int, last: int) -> dict[int, float]:
    """The loop's protocol around the stream; returns when each step's training ended."""
    trained = {}
    for step in range(first, last):
        batch, _ = stream.take(step)
        assert batch == step
        time.sleep(0.15)  # training (long enough for the producer's thread to wake, on a loaded machine too)
        trained[step] = time.perf_counter()
        stream.ready_to_sync(step + 1)
        assert not engines.busy.locked(), "weights synced while a batch was being collected"
        engines.version = step + 1
        stream.synced(step + 1)
    return trained


@pytest.mark.parametrize("k", [0, 1, 2])
def test_batch_b_is_generated_under_version_b_minus_k_and_overlaps_training(k: int) -> None:
    engines = Engines()
    stream = RolloutStream(engines.produce, engines.snapshot, k, first=0, last=8)
    try:
        trained = _train(stream, engines, 0, 8)
    finally:
        stream.close()
    assert {b: v for b, (v, _, _) in engines.collected.items()} == {b: max(0, b - k) for b in range(8)}
    # with k >= 1 batch s + 1 starts before step s has finished training; with k = 0 only after
    started_early = [engines.collected[s + 1][1] < trained[s] for s in range(7)]
    assert all(started_early) if k else not any(started_early)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_the_intake_keeps_samples_k_versions_old_and_drops_one_more(k: int) -> None:
    # the loop's intake (loops/grpo.py, step 1-2): a sample k versions behind the step is trained, k + 1 is not;
    # the fixed schedule generates batch b under max(0, b - k), so its oldest samples sit exactly on the bound
    for step in (k, k + 5):
        assert not too_stale(step, step, k)
        assert not too_stale(step, step - k, k)
        assert too_stale(step, step - k - 1, k)
    assert [too_stale(b, max(0, b - k), k) for b in range(8)] == [False] * 8
    if k:  # a run resumed with a smaller bound drops what the schedule made under the larger one
        assert too_stale(k + 5, 5, k - 1)


def test_pending_batches_carry_over_to_a_resumed_stream() -> None:
    engines = Engines()
    stream = RolloutStream(engines.produce, engines.snapshot, 2, first=0, last=10)
    _train(stream, engines, 0, 3)  # the producer is released after the sync of version 3
    stream.close()
    time.sleep(0.1)  # a collect released by the last sync may still finish; it is not part of the snapshot
    # what a checkpoint at step 3 held: read between ready_to_sync and synced, batches 3 and 4 (under versions 1, 2)
    engines2 = Engines()
    engines2.version = 3
    resumed = RolloutStream(
        engines2.produce, engines2.snapshot, 2, first=3, last=10, buffered=[3, 4], version=3
    )
    try:
        _train(resumed, engines2, 3, 10)
    finally:
        resumed.close()
    # the resumed stream generates from batch 5 on, under version 3 = 5 - k, as the uninterrupted one would
    assert sorted(engines2.collected) == list(range(5, 10))
    assert {b: v for b, (v, _, _) in engines2.collected.items()} == {b: b - 2 for b in range(5, 10)}


def test_a_synchronous_stream_hands_out_batches_generated_ahead_first() -> None:
    """A run that generated ahead, resumed with max_staleness=0: the saved batch comes first, then it collects."""
    engines = Engines()
    stream = RolloutStream(engines.produce, engines.snapshot, 0, first=3, last=6, buffered=[3], version=3)
    assert [stream.take(b)[0] for b in (3, 4, 5)] == [3, 4, 5]
    assert sorted(engines.collected) == [4, 5]


def test_checkpoint_is_what_was_generated_and_not_taken_with_the_snapshot_after_it() -> None:
    engines = Engines()
    stream = RolloutStream(engines.produce, engines.snapshot, 2, first=0, last=10)
    try:
        for step in range(3):
            stream.take(step)
            stream.ready_to_sync(step + 1)
            if step == 2:
                assert stream.checkpoint() == ([3, 4], 5)  # batches 0..4 collected
            engines.version = step + 1
            stream.synced(step + 1)
    finally:
        stream.close()


def test_a_collect_that_raises_raises_in_the_trainer() -> None:
    def produce(b: int) -> int:
        if b == 2:
            raise RuntimeError("engine 0 died past its replacements")
        return b

    stream = RolloutStream(produce, lambda: None, 1, first=0, last=5)
    try:
        assert stream.take(0)[0] == 0
        stream.synced(1)
        assert stream.take(1)[0] == 1
        with pytest.raises(RuntimeError, match="engine 0 died"):
            stream.ready_to_sync(2)  # batch 2 (under version 1) failed
    finally:
        stream.close()


def test_idle_fraction_counts_the_collects_in_a_window() -> None:
    stream = RolloutStream(lambda b: time.sleep(0.1) or b, lambda: None, 0, first=0, last=3)
    before = time.perf_counter()
    stream.take(0)
    after = time.perf_counter()
    # a window as long again before the collect: half of it idle (the collect is all but the call's overhead)
    idle = stream.idle_fraction(before - (after - before), after)
    assert 0.49 < idle < 0.55, idle
    assert stream.idle_fraction(after, after + 1.0) == 1.0  # nothing collected since


def test_the_trainer_waits_for_a_batch_in_flight_only_to_scale(tmp_path: Path) -> None:
    release, started = threading.Event(), threading.Event()

    def produce(b: int) -> int:
        started.set()
        release.wait(10)
        return b

    resized: list[tuple[int, bool]] = []  # (engines, whether the batch in flight had finished)
    engines = SimpleNamespace(resize=lambda n: resized.append((n, release.is_set())))
    ctx = SimpleNamespace(run_dir=tmp_path, rollout=engines)  # what scale_between_batches reads of the run
    stream = RolloutStream(produce, lambda: None, 1, first=0, last=2)
    try:
        assert started.wait(5)  # batch 0 is being collected
        t0 = time.perf_counter()
        assert scale_between_batches(ctx, stream) == {}  # no request: no wait
        assert time.perf_counter() - t0 < 1.0
        write_scale_request(tmp_path, {"engines": 2})
        threading.Timer(0.3, release.set).start()
        assert scale_between_batches(ctx, stream)["engines"] == 2
        assert resized == [(2, True)]  # applied once the batch was collected, not under it
    finally:
        release.set()
        stream.close()


class SlowEngines(Engines):
    """Generation slower than training: the case partial rollouts are for."""

    def produce(self, b: int) -> int:
        assert self.busy.acquire(blocking=False), "two collects at once"
        start, version = time.perf_counter(), self.version
        time.sleep(0.25)
        self.collected[b] = (version, start, time.perf_counter())
        self.busy.release()
        return b


def test_partial_rollouts_sync_at_once_and_start_batches_under_the_newest_weights() -> None:
    """With partial rollouts the trainer never waits to sync (engines take the weights mid-batch), a batch starts
    under the newest version, at most k behind: when generation is the slower side, staleness stays below k."""
    engines = SlowEngines()
    stream = RolloutStream(engines.produce, engines.snapshot, 2, first=0, last=8, partial=True)
    synced_mid_batch = 0
    try:
        for step in range(8):
            stream.take(step)
            time.sleep(0.05)  # training
            assert stream.ready_to_sync(step + 1) == 0.0
            synced_mid_batch += engines.busy.locked()
            engines.version = step + 1
            stream.synced(step + 1)
    finally:
        stream.close()
    behind = {b: b - v for b, (v, _, _) in engines.collected.items()}
    assert all(0 <= d <= 2 for d in behind.values()), behind
    assert sum(behind.values()) / len(behind) < 2 and synced_mid_batch >= 4


@pytest.mark.parametrize("partial", [False, True])
def test_when_training_is_slower_partial_rollouts_keep_staleness_below_the_bound(partial: bool) -> None:
    """Generation faster than training, k = 2: the fixed schedule runs two versions ahead (staleness 2 from step 2
    on); with partial rollouts no batch starts while a finished one waits, so batches are one version old."""
    engines = Engines()  # a collect takes 0.03 s, a step 0.15 s
    stream = RolloutStream(engines.produce, engines.snapshot, 2, first=0, last=7, partial=partial)
    try:
        for step in range(7):
            stream.take(step)
            time.sleep(0.15)
            stream.ready_to_sync(step + 1)
            engines.version = step + 1
            stream.synced(step + 1)
    finally:
        stream.close()
    behind = [b - v for b, (v, _, _) in sorted(engines.collected.items())]
    assert behind[2:] == ([1] * 5 if partial else [2] * 5), behind


def test_a_partial_checkpoint_leaves_out_the_batch_in_flight() -> None:
    release, started = threading.Event(), threading.Event()
    collected: list[int] = []

    def produce(b: int) -> int:
        if b == 2:
            started.set()
            release.wait(10)
        collected.append(b)
        return b

    stream = RolloutStream(produce, lambda: len(collected), 2, first=0, last=5, partial=True)
    try:
        assert [stream.take(0)[0], stream.take(1)[0]] == [0, 1]
        assert started.wait(5)  # batch 2 in flight
        assert stream.checkpoint() == ([], 2)  # the snapshot after batch 1, not after the batch in flight
    finally:
        release.set()
        stream.close()


def test_partial_rollouts_need_max_staleness() -> None:
    with pytest.raises(ConfigError, match="set max_staleness >= 1"):
        load_config(overrides=["grpo.partial_rollouts=recompute_kv"])
    with pytest.raises(ConfigError, match="partial_rollouts"):
        load_config(overrides=["grpo.partial_rollouts=sometimes"])


def test_max_staleness_needs_ray_and_a_behaviour_correction() -> None:
    with pytest.raises(ConfigError, match="needs runtime.backend=ray"):
        load_config(overrides=["grpo.max_staleness=1", "grpo.behaviour_correction=tis"])
    with pytest.raises(ConfigError, match="set behaviour_correction"):
        load_config(overrides=["grpo.max_staleness=1", "runtime.backend=ray"])
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(overrides=["grpo.max_staleness=-1"])
    cfg = load_config(
        overrides=["grpo.max_staleness=2", "runtime.backend=ray", "grpo.behaviour_correction=tis"]
    )
    assert cfg.grpo.max_staleness == 2


# ------------------------------------------------------------------------------------------------------------
# The loop on Ray
# ------------------------------------------------------------------------------------------------------------

ARGS = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.stop_at_accuracy=null",
    "grpo.stop_at_accuracy=null", "grpo.steps=5", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=16",
    "grpo.eval_every=0", "grpo.optim.lr=1e-2", "grpo.optim.warmup_steps=0", "grpo.behaviour_correction=tis",
    "grpo.entropy_coef=0.01", "grpo.sampling.max_new_tokens=32",  # a rollout long enough to overlap
    "data.task.num_train=40", "data.task.num_eval=4", "eval.num_prompts=4", "checkpoint_every=2",
    "progress=false", "tensorboard=false", "threads=1", "deterministic=true",
    "runtime.backend=ray", "runtime.engines=1", "runtime.env_workers=1", "runtime.call_timeout_s=120",
]  # fmt: skip
FINAL = "grpo-000005"


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "checkpoints" / FINAL / "model" / "model.safetensors")


@pytest.mark.heavy
@pytest.mark.slow
def test_async_run_resumes_exactly_trains_each_sample_once_within_the_bound(
    ray_cluster, tmp_path: Path
) -> None:
    import ray

    address = f"runtime.cluster.address={ray.get_runtime_context().gcs_address}"
    args = [*ARGS, address, "grpo.max_staleness=1"]
    reference = tmp_path / "reference"
    assert main(["train", *args, f"out_dir={reference}"]) == 0
    rows = [r for r in read_metrics(reference) if r["phase"] == "grpo" and r["step"] > 0]
    # the first batch comes from the weights RL starts from, every later one from the version before
    assert [r["staleness_max"] for r in rows] == [0, 1, 1, 1, 1]
    assert [r["staleness_1"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r["stale_dropped"] == 0 and 0 <= r["engine_idle_fraction"] <= 1 for r in rows)
    # samples one version old were weighted: the behaviour weight moved off 1 once the weights did
    assert rows[0]["behaviour_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert max(abs(r["behaviour_weight_min"] - 1) for r in rows[1:]) > 1e-4
    # generation overlapped training after the first step too (nothing on the trainer's side waits for a batch in
    # flight that it does not need): a rollout span runs while a later step's train span does
    spans = read_spans(reference / "trace.json")
    rollouts = [(s, e) for lane, name, s, e in spans if lane == "rollout" and name == "rollout"]
    trains = [(s, e) for lane, name, s, e in spans if lane == "trainer" and name == "train"]
    assert len(rollouts) == len(trains) == 5
    assert any(rs < te and ts < re for rs, re in rollouts for ts, te in trains[1:])

    # SIGKILLed with step 3 logged but not checkpointed: the resume starts from grpo-000002, whose loop state
    # holds batch 2 (generated under version 1), and must replay steps 3-5 exactly
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "loopline.cli", "train", *args, f"out_dir={run}"]
    kill_at(cmd, "step:grpo:3", tmp_path / "markers", 300)
    assert (run / "checkpoints" / "latest").read_text().strip() == "grpo-000002"
    saved = torch.load(run / "checkpoints" / "grpo-000002" / "loop.pt", weights_only=False)
    assert [{c.policy_version for c in b.completions} for b in saved["buffer"]] == [{1}]
    shutil.copytree(run, tmp_path / "run-k0")
    assert main(["train", "--resume", *args, f"out_dir={run}"]) == 0
    assert steady(read_metrics(run)) == steady(read_metrics(reference))
    a, b = _weights(run), _weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ledger = read_ledger(run)
    assert [r["step"] for r in ledger if r["phase"] == "grpo"] == [1, 2, 3, 4, 5]
    assert not repeats(ledger)

    # resumed synchronous (a smaller bound: --allow-config-change): the saved batch, one version old, is past it,
    # so it is dropped, counted, and collected again under the current weights; no sample is trained twice
    k0 = tmp_path / "run-k0"
    resume_k0 = ["train", "--resume", *args, "grpo.max_staleness=0", f"out_dir={k0}", "--allow-config-change"]
    assert main(resume_k0) == 0
    resumed = {r["step"]: r for r in read_metrics(k0) if r["phase"] == "grpo"}
    assert resumed[3]["stale_dropped"] == 16 and "stale_dropped" not in resumed[4]
    assert not repeats(read_ledger(k0))


@pytest.mark.slow
def test_partial_rollouts_on_ray_stay_within_the_bound_and_resume_exactly_once(
    ray_cluster, tmp_path: Path
) -> None:
    """k = 2 with partial rollouts on a local Ray cluster, generation slower than training (4 rows at a time):
    engines take weights mid-batch, every token records its version, no sample is more than k versions old by its
    first token, and a run SIGKILLed mid-way resumes without losing or repeating a sample, the bound holding after
    the resume; the engines end with the trainer's weights."""
    import ray

    address = f"runtime.cluster.address={ray.get_runtime_context().gcs_address}"
    args = [
        *ARGS, address, "grpo.max_staleness=2", "grpo.partial_rollouts=recompute_kv", "runtime.engine_max_rows=4",
        "grpo.stop_at_accuracy=null", "grpo.steps=6", "deterministic=false",
    ]  # fmt: skip
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "loopline.cli", "train", *args, f"out_dir={run}"]
    kill_at(cmd, "step:grpo:3", tmp_path / "markers", 300)
    saved = torch.load(run / "checkpoints" / "grpo-000002" / "loop.pt", weights_only=False)
    for b, batch in enumerate(saved.get("buffer", []), start=2):  # generated ahead (if any), within the bound
        assert all(b - c.policy_version <= 2 for c in batch.completions)
        assert all(c.token_versions and c.policy_version == min(c.token_versions) for c in batch.completions)
    assert main(["train", "--resume", *args, f"out_dir={run}"]) == 0
    rows = {r["step"]: r for r in read_metrics(run) if r["phase"] == "grpo" and r["step"] > 0}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= 2 and r["stale_dropped"] == 0 for r in rows.values())
    assert max(r["partial_fraction"] for r in rows.values()) > 0  # weights did land mid-batch
    ledger = read_ledger(run)
    assert [r["step"] for r in ledger if r["phase"] == "grpo"] == [1, 2, 3, 4, 5, 6]
    assert not repeats(ledger)
