"""`loopline dpo` and `loopline rm` on the ray backend: 2 FSDP2 actor ranks share each batch of pairs.

The same short runs on the local backend (one rank) are the reference: the 2-rank runs log the same rows up
to float reordering (each rank sums its half of the pairs, gradients are summed over the ranks). DPO asks
its reference per batch (dpo.reference=online: the reference role's ranks); the held-out pairs are an odd
number, so the per-row calls pad the last rank's slice. The session's one Ray (tests/conftest.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch
from safetensors.torch import load_file

from loopline.cli import main
from loopline.config import load_config
from loopline.metrics.logger import read_metrics
from loopline.models import load_policy
from loopline.training.critic import ScalarModel
from tests.numerics import assert_adam_updates_close
from tests.runs import steady

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TINY = [
    "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
    "data.task.num_train=64", "data.task.num_eval=11", "eval.num_prompts=4", "preference.num_train=16",
    "preference.num_eval=11", "progress=false", "tensorboard=false", "threads=1",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
]  # fmt: skip
RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=1",
    "runtime.call_timeout_s=180",  # actor start-up (a new process importing torch) under a loaded CI
]  # fmt: skip
DPO = [
    "dpo.steps=2", "dpo.batch_size=8", "dpo.micro_batch_size=2", "dpo.eval_every=0",
    "dpo.optim.warmup_steps=0", "dpo.reference=online",
]  # fmt: skip
RM = ["rm.steps=2", "rm.batch_size=8", "rm.micro_batch_size=2", "rm.eval_every=0", "rm.optim.warmup_steps=0"]
# greedy generations (eval_accuracy, eval_response_len) may flip on a float-level difference: not compared
COMPARED_EXCEPT = ("phase", "lr", "eval_accuracy", "eval_response_len")


def _same_rows(local: list[dict], ray: list[dict]) -> None:
    assert [(r["phase"], r["step"]) for r in ray] == [(r["phase"], r["step"]) for r in local]
    for a, b in zip(local, ray, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if k not in COMPARED_EXCEPT:
                assert b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5), (a["phase"], a["step"], k)


def test_dpo_on_two_ray_ranks_matches_one_local_rank(ray_cluster, tmp_path):
    local, ray = tmp_path / "local", tmp_path / "ray"
    assert main(["dpo", *TINY, *DPO, f"out_dir={local}"]) == 0
    assert main(["dpo", *TINY, *DPO, *RAY, f"out_dir={ray}"]) == 0
    rows = steady(read_metrics(ray))
    assert [r["step"] for r in rows if r["phase"] == "dpo"] == [0, 1, 2]
    assert rows[-1]["eval_pref_accuracy"] >= 0.0 and rows[-2]["pref_loss"] == pytest.approx(0.6931, abs=1e-3)
    _same_rows(steady(read_metrics(local)), rows)
    # the checkpoint writer the other loops use: every rank's shards, and the whole policy (model/)
    assert (ray / "checkpoints" / "dpo-000002" / "dcp" / ".metadata").is_file()
    ours, theirs = (load_file(run / "model" / "model.safetensors") for run in (ray, local))
    assert ours.keys() == theirs.keys()
    _same_update(_initial_policy(), theirs, ours, local)


@pytest.mark.heavy
def test_rm_on_two_ray_ranks_matches_one_local_rank(ray_cluster, tmp_path):
    local, ray = tmp_path / "local", tmp_path / "ray"
    assert main(["rm", *TINY, *RM, f"out_dir={local}"]) == 0
    assert main(["rm", *TINY, *RM, *RAY, f"out_dir={ray}"]) == 0
    rows = steady(read_metrics(ray))
    assert [r["step"] for r in rows if r["phase"] == "rm"] == [0, 1, 2]
    assert rows[-1]["eval_pair_accuracy"] >= 0.0
    _same_rows(steady(read_metrics(local)), rows)
    ours, theirs = ScalarModel.load(ray / "reward_model"), ScalarModel.load(local / "reward_model")
    assert ours.head.weight.abs().sum() > 0  # the head trained on the ranks and came back whole
    policy = _initial_policy()  # the body starts as the policy's (SFT, then RM steps), the head at zero
    before = {
        k: policy["model." + k.removeprefix("body.")] if k.startswith("body.") else torch.zeros_like(v)
        for k, v in theirs.state_dict().items()
    }
    _same_update(before, theirs.state_dict(), ours.state_dict(), local)


def _initial_policy() -> dict[str, torch.Tensor]:
    cfg = load_config(overrides=TINY)
    return load_policy(cfg.model, seed=cfg.seed)[0].state_dict()


def _same_update(before: dict, local_w: dict, ray_w: dict, local_run) -> None:
    """The same updates up to float reordering: tests/numerics.py's rule over the run's steps (SFT, then the
    phase: each a fresh AdamW, whose bound grows with the step, so one sequence of steps bounds both)."""
    lrs = [r["lr"] for r in steady(read_metrics(local_run)) if r["step"] > 0 and "lr" in r]
    assert len(lrs) == 4  # 2 SFT steps and 2 of the phase
    assert_adam_updates_close(before, local_w, ray_w, lrs=lrs)
