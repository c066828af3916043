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
from loopline.metrics.logger import read_metrics
from loopline.training.critic import ScalarModel
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
    for k in ours:  # the same update up to float reordering
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-3, atol=1e-5)


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
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=name)
