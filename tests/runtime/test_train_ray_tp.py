"""`loopline train` on the ray backend with a tensor-parallel actor: 2 trainer ranks at trainer_tp=2 (dp=1).

Against the local backend on the same short job: the SFT losses and grad norms agree (the two TP ranks
split every decoder layer and take the same rows, counted once), so do the SFT checkpoint's whole
weights (to AdamW-amplified rounding), and the greedy held-out eval after SFT, which runs on the engine:
the planned weight sync read the TP shards where the planner put them.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
from safetensors.torch import load_file

from loopline.cli import main
from loopline.config import load_config
from loopline.metrics.logger import read_metrics
from loopline.models import load_policy
from tests.numerics import assert_adam_updates_close

SMALL = [
    "sft.steps=3", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=0",
    "sft.optim.lr=1e-2", "sft.optim.warmup_steps=0",  # a big first step: eval after SFT sees a change
    "grpo.steps=1", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.micro_batch_size=8",
    "grpo.entropy_coef=0.01", "grpo.eval_every=0", "eval.num_prompts=16", "eval.batch_size=16",
    "checkpoint_every=3", "progress=false", "tensorboard=false", "threads=1", "seed=3",
    "data.task.teacher_drops_carries=0",  # the data the tolerance below was measured on
]  # fmt: skip
RAY_TP = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.trainer_tp=2", "runtime.engines=1",
    "runtime.env_workers=1", "runtime.call_timeout_s=120",
]  # fmt: skip
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same short job on the local backend and on the session's Ray with a TP=2 actor."""
    out = tmp_path_factory.mktemp("train_tp")
    assert main(["train", f"out_dir={out / 'local'}", *SMALL]) == 0
    assert main(["train", f"out_dir={out / 'ray'}", *SMALL, *RAY_TP]) == 0
    return {"local": out / "local", "ray": out / "ray"}


def _rows(run: Path, phase: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if r["phase"] == phase}


def test_tp_actor_on_ray_trains_like_the_local_backend(runs: dict[str, Path]) -> None:
    local, ray_ = (_rows(runs[b], "sft") for b in ("local", "ray"))
    for step in (1, 2, 3):
        assert ray_[step]["loss"] == pytest.approx(local[step]["loss"], rel=1e-5), step
        assert ray_[step]["grad_norm"] == pytest.approx(local[step]["grad_norm"], rel=1e-4), step
    w_local, w_ray = (
        load_file(runs[b] / "checkpoints" / "sft-000003" / "model" / "model.safetensors")
        for b in ("local", "ray")
    )
    assert w_local.keys() == w_ray.keys()
    # TP splits the sums inside each matmul (rowwise layers add partial products across the ranks), so the
    # gradients differ from one rank's by float rounding, which AdamW amplifies where a gradient is ~0: the
    # rule for two orders of summing (tests/numerics.py; gradient-free: the runs keep no gradients)
    cfg = load_config(overrides=SMALL)
    init = load_policy(cfg.model, seed=3)[0].state_dict()
    lrs = [local[step]["lr"] for step in (1, 2, 3)]
    assert_adam_updates_close(init, w_local, w_ray, lrs=lrs, betas=cfg.sft.optim.betas)
    # greedy eval on the engine after SFT: the weight sync carried the trained weights out of the TP shards
    g_local, g_ray = (_rows(runs[b], "grpo") for b in ("local", "ray"))
    assert g_local[0]["eval_response_len"] != local[0]["eval_response_len"]  # SFT changed what eval sees
    assert g_ray[0]["eval_accuracy"] == g_local[0]["eval_accuracy"]
    assert g_ray[0]["eval_response_len"] == g_local[0]["eval_response_len"]
    # the engine then samples GRPO's batch: the first update's loss is the local one's (within sampling noise)
    assert g_ray[1]["loss"] == pytest.approx(g_local[1]["loss"], rel=0.2)
