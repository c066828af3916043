"""`loopline train` on the ray backend: 2 FSDP2 trainer ranks, 1 engine, 2 env workers on a local Ray.

The session's one Ray (tests/conftest.py) holds both ray runs. A short run
through the real CLI must finish, write its metrics, move the weights in SFT and in GRPO, and agree
with the local backend where the two must agree: the SFT losses (same data, same initial weights;
the ranks each take half of every batch) and the greedy held-out eval after SFT (which runs on the
engine, so the planned weight sync delivered the trained weights). GRPO samples on the engine's own
RNG, so there the check is that the first-step loss is close, not equal. Then --resume with more steps
continues from the ray checkpoint. Every call on a worker group is bounded by runtime.call_timeout_s.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch
from safetensors.torch import load_file

from loopline.checkpoint.dcp import read_full_state
from loopline.cli import main
from loopline.config import load_config
from loopline.metrics.logger import read_metrics
from loopline.models import load_policy

SMALL = [
    "sft.steps=4", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=0",
    # a big first step, so that greedy eval after SFT differs from eval of the initial weights
    "sft.optim.lr=1e-2", "sft.optim.warmup_steps=0",
    "grpo.steps=3", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=8",
    # zero rewards are likely this early; the entropy bonus and KL still give GRPO a gradient
    "grpo.entropy_coef=0.01", "grpo.kl_coef=0.01", "grpo.eval_every=0",
    "eval.num_prompts=16", "eval.batch_size=16",
    "checkpoint_every=2", "progress=false", "tensorboard=false", "threads=1", "seed=3",
]  # fmt: skip
pytestmark = pytest.mark.slow

RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=2",
    "runtime.call_timeout_s=180",  # actor start-up (a new process importing torch) under a loaded CI
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same short job on the local and on the ray backend."""
    out = tmp_path_factory.mktemp("train")
    assert main(["train", f"out_dir={out / 'local'}", *SMALL]) == 0
    assert main(["train", f"out_dir={out / 'ray'}", *SMALL, *RAY]) == 0
    return {"local": out / "local", "ray": out / "ray"}


def _rows(run: Path, phase: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if r["phase"] == phase}


def _weights(run: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / name / "model" / "model.safetensors")


def test_ray_run_writes_metrics_and_moves_weights(runs: dict[str, Path]) -> None:
    run = runs["ray"]
    sft, grpo = _rows(run, "sft"), _rows(run, "grpo")
    assert sorted(sft) == [0, 1, 2, 3, 4] and sorted(grpo) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        row = grpo[step]
        for key in ("reward_mean", "loss", "kl", "entropy", "grad_norm", "response_len_mean"):
            assert math.isfinite(row[key]), (step, key)
        assert row["grad_norm"] > 0  # the entropy bonus gives a gradient even with all rewards 0
        # the env pool's counts: no worker died, both env workers kept
        assert (row["score_retries"], row["env_workers_replaced"], row["env_workers"]) == (0, 0, 2)
    assert "eval_accuracy" in grpo[3]
    init = load_policy(load_config(overrides=SMALL).model, seed=3)[0].state_dict()
    after_sft, after_grpo = _weights(run, "sft-000004"), _weights(run, "grpo-000003")
    assert any(not torch.equal(after_sft[k], init[k]) for k in after_sft), "SFT did not move the weights"
    assert any(not torch.equal(after_grpo[k], after_sft[k]) for k in after_sft), (
        "GRPO did not move the weights"
    )


def test_ray_run_agrees_with_the_local_backend(runs: dict[str, Path]) -> None:
    local, ray_ = (_rows(runs[b], "sft") for b in ("local", "ray"))
    for step in (1, 2, 3, 4):
        assert ray_[step]["loss"] == pytest.approx(local[step]["loss"], rel=1e-5), step
        assert ray_[step]["grad_norm"] == pytest.approx(local[step]["grad_norm"], rel=1e-4), step
    # the SFT checkpoints agree to float tolerance: same updates on 2 ranks as on one
    w_local, w_ray = _weights(runs["local"], "sft-000004"), _weights(runs["ray"], "sft-000004")
    for name in w_local:
        torch.testing.assert_close(w_ray[name], w_local[name], rtol=0, atol=1e-5, msg=name)
    # greedy eval on the engine after SFT: the weight sync carried the trained weights
    g_local, g_ray = (_rows(runs[b], "grpo") for b in ("local", "ray"))
    assert g_local[0]["eval_response_len"] != local[0]["eval_response_len"]  # SFT changed what eval sees
    assert g_ray[0]["eval_accuracy"] == g_local[0]["eval_accuracy"]
    assert g_ray[0]["eval_response_len"] == g_local[0]["eval_response_len"]
    # GRPO samples differ (each backend's engine has its own RNG), so the first losses are not compared
    # with each other: each is checked against its parts (token means, grpo.loss_agg=token_mean):
    # policy loss + kl_coef * KL - entropy_coef * entropy, with KL 0 (policy = reference before the first
    # update) and a zero policy loss when every reward ties (all advantages 0)
    for first in (g_local[1], g_ray[1]):
        assert first["kl"] == pytest.approx(0.0, abs=1e-6)
        parts = first["policy_loss"] + 0.01 * first["kl"] - 0.01 * first["entropy"]
        assert first["loss"] == pytest.approx(parts, rel=1e-5, abs=1e-8)
        if first["reward_std"] == 0.0:
            assert first["policy_loss"] == 0.0
    assert g_ray[1]["entropy"] == pytest.approx(g_local[1]["entropy"], rel=0.05)


def test_ray_run_resumes_from_its_checkpoint(runs: dict[str, Path], tmp_path: Path) -> None:
    # on a copy: the resumed run prunes old checkpoints (keep_last), which the other tests read, in any order
    run = tmp_path / "ray"
    shutil.copytree(runs["ray"], run)
    more = [f"out_dir={run}", *SMALL, *RAY, "grpo.steps=4", "grpo.kl_coef=0"]  # (KL resume needs the ref)
    assert main(["train", "--resume", *more, "--allow-config-change"]) == 0  # grpo.kl_coef changes
    grpo = _rows(run, "grpo")
    assert sorted(grpo) == [0, 1, 2, 3, 4]
    # the ranks continued from the checkpoint's weights (pushed to them), not from the initial ones
    init = load_policy(load_config(overrides=SMALL).model, seed=3)[0].state_dict()
    w3, w4 = _weights(run, "grpo-000003"), _weights(run, "grpo-000004")
    step = max(float((w4[k] - w3[k]).abs().max()) for k in w3)
    assert 0 < step < 3e-3  # one AdamW step at lr 5e-4
    assert max(float((w3[k] - init[k]).abs().max()) for k in w3) > 10 * step
    resumed = read_full_state(run / "checkpoints" / "grpo-000004" / "dcp")  # the ranks' DCP shards, whole
    assert resumed["scheduler"]["last_epoch"] == 4  # the LR schedule continued from step 3
    assert len(resumed["optim"]["state"]) > 0  # the optimizer state, from the ranks' shards
