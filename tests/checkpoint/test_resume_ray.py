"""Exact resume on the ray backend: 2 FSDP2 trainer ranks, 1 engine, KL to a frozen reference.

`loopline train` is SIGKILLed inside GRPO (held by the LOOPLINE_PAUSE_AT hook) and resumed with --resume; it
must end bitwise equal to the same run never interrupted: both ranks' policy and reference shards, the
gathered weights, the engine's sampling generator and every metrics row. Then the 2-rank checkpoint resumes
on the local backend (one rank): the reference shards are resharded like the policy's, and the run says
that it cannot replay the engine's samples (another backend).

The session's one Ray (tests/conftest.py). The uninterrupted run and the resumes run in this
process; the killed launch is a process of its own that joins this Ray by address, so its actors die with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch
from safetensors.torch import load_file

from loopline.checkpoint.dcp import read_full_state
from loopline.cli import main
from loopline.metrics.logger import read_metrics

pytestmark = pytest.mark.slow

ARGS = [
    "sft.steps=1", "sft.batch_size=4", "sft.micro_batch_size=4", "sft.eval_every=0",
    "grpo.steps=4", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.micro_batch_size=4",
    "grpo.eval_every=0", "grpo.entropy_coef=0.01", "grpo.kl_coef=0.05", "grpo.optim.lr=1e-3",
    "grpo.optim.warmup_steps=0", "data.task.num_train=8", "data.task.num_eval=2", "eval.num_prompts=2",
    "checkpoint_every=2", "progress=false", "tensorboard=false", "threads=1", "deterministic=true",
]  # fmt: skip
RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=1",
    "runtime.call_timeout_s=180",  # actor start-up (a new process importing torch) under a loaded CI
]  # fmt: skip
FINAL = "grpo-000004"
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def ray_address(ray_cluster) -> str:
    """The session's Ray (tests/conftest.py): its GCS address, for the killed launch to join."""
    import ray

    return ray.get_runtime_context().gcs_address


def _wait_for_free_cpus(timeout_s: float = 60.0) -> None:
    """Until Ray has ended the killed driver's actors and placement groups: every CPU free again."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, (
            f"the killed run's resources were not freed: {ray.available_resources()}"
        )
        time.sleep(0.2)


def _kill_at(run: Path, point: str, address: str) -> None:
    """Start `loopline train` on this Ray in a process of its own, wait until it is held at `point`, SIGKILL it."""
    markers = run.parent / f"markers-{run.name}"
    marker = markers / f"{point.replace(':', '_')}.paused"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_PAUSE")}
    env.update(LOOPLINE_PAUSE_AT=point, LOOPLINE_PAUSE_DIR=str(markers))
    cmd = [sys.executable, "-m", "loopline.cli", "train", *ARGS, *RAY, f"runtime.cluster.address={address}"]
    proc = subprocess.Popen(
        [*cmd, f"out_dir={run}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(
                    f"run ended (rc {proc.returncode}) before {point}: {proc.stderr.read()[-3000:]}"
                )
            assert time.monotonic() < deadline, f"run did not reach {point} within {RUN_TIMEOUT_S}s"
            time.sleep(0.1)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _steady(run: Path) -> list[dict]:
    """Metrics rows without wall-clock measurements (those differ between any two runs)."""
    return [
        {k: v for k, v in r.items() if not k.startswith("time_") and not k.endswith("tokens_per_s")}
        for r in read_metrics(run)
    ]


def test_a_killed_ray_run_resumes_bitwise_then_reshards_onto_one_rank(
    ray_address: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference = tmp_path / "reference"
    assert main(["train", *ARGS, *RAY, f"out_dir={reference}"]) == 0
    run = tmp_path / "run"
    _kill_at(run, "step:grpo:3", ray_address)  # step 3 logged, its checkpoint not written
    assert (run / "checkpoints" / "latest").read_text().strip() == "grpo-000002"
    _wait_for_free_cpus()
    assert main(["train", "--resume", *ARGS, *RAY, f"out_dir={run}"]) == 0

    a, b = run / "checkpoints" / FINAL, reference / "checkpoints" / FINAL
    names = ["model/model.safetensors", "state.json"]
    names += [f"{part}/__{rank}_0.distcp" for part in ("dcp", "reference") for rank in (0, 1)]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    engines = [torch.load(c / "loop.pt", weights_only=False)["engine_rng"] for c in (a, b)]
    assert len(engines[0]) == 1 and torch.equal(engines[0][0], engines[1][0])
    assert _steady(run) == _steady(reference)
    grpo = {r["step"]: r for r in read_metrics(run) if r["phase"] == "grpo"}
    assert grpo[3]["kl"] > 0  # the resumed step measured KL to the saved reference, not to itself

    # the reference the ranks saved is the policy as GRPO started: the weights after SFT
    sft = load_file(run / "checkpoints" / "sft-000001" / "model" / "model.safetensors")
    saved_reference = read_full_state(a / "reference")["model"]
    for name, weights in sft.items():
        assert torch.equal(saved_reference[name], weights), name

    # 2 ranks -> 1: the local backend reshards policy and reference, and cannot replay the engine's samples
    # (--resume starts from the saved config, which is ray: the backend is changed explicitly)
    local = ["runtime.backend=local", "runtime.trainer_ranks=1"]
    with caplog.at_level(logging.WARNING, logger="loopline.loops.grpo"):
        assert main(["train", "--resume", *ARGS, *local, "grpo.steps=5", f"out_dir={run}"]) == 0
    assert "does not replay the uninterrupted one exactly" in caplog.text
    step5 = [r for r in read_metrics(run) if r["phase"] == "grpo"][-1]
    assert step5["step"] == 5 and 0 < step5["kl"] < 1.0
