"""`loopline train` on the scaled-down Qwen3-MoE preset with expert parallelism on Ray: 2 trainer ranks, each MoE
layer's 128 experts split 64 + 64 (`runtime.trainer_ep=2`), routing replay on, SFT then GRPO steps.

The run must finish and train the experts; a launch SIGKILLed inside GRPO and resumed with --resume must end
bitwise equal to it (the ranks' DCP shards, the gathered weights, every metrics row); the checkpoint's DCP shards
hold every expert whole, as its HF weights do; the 2-rank expert-parallel checkpoint resumes on one rank of
the local backend (the experts whole, no expert parallelism) for one more step; and after a step the engine
holds every expert bitwise as the trainer ranks do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch
from safetensors.torch import load_file

from loopline.checkpoint.dcp import read_full_state
from loopline.cli import main
from loopline.config import OptimConfig, load_config
from loopline.data.batches import collate
from loopline.metrics.logger import read_metrics
from loopline.models.load import load_policy
from loopline.runtime.roles import build_roles
from tests.runs import kill_at, steady

pytestmark = pytest.mark.slow

JOB = [
    "model.init=random", "model.preset=qwen3-moe-tiny", "grpo.routing_replay=true",
    "data.task.num_train=32", "data.task.num_eval=4", "data.task.num_val=4", "eval.num_prompts=4",
    "eval.sampling.max_new_tokens=6", "sft.steps=2", "sft.batch_size=8", "sft.micro_batch_size=4",
    "sft.eval_every=0", "sft.stop_at_accuracy=null", "grpo.steps=2", "grpo.stop_at_accuracy=null",
    "grpo.prompts_per_step=4", "grpo.group_size=2", "grpo.micro_batch_size=2", "grpo.eval_every=0",
    "grpo.sampling.max_new_tokens=6", "grpo.entropy_coef=0.01",  # a gradient even when every reward is 0
    "checkpoint_every=1", "progress=false", "tensorboard=false", "threads=1", "seed=3", "deterministic=true",
]  # fmt: skip
RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.trainer_ep=2", "runtime.engines=1",
    "runtime.env_workers=1", "runtime.call_timeout_s=180",
]  # fmt: skip
RUN_TIMEOUT_S = 300
FINAL = "grpo-000002"
EXPERTS = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """The trained BPE tokenizer goes to a cache of the session's own, never the user's ~/.cache."""
    monkeypatch.setenv("LOOPLINE_CACHE", str(tmp_path_factory.getbasetemp() / "loopline-cache"))


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ep") / "run"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOOPLINE_CACHE", str(tmp_path_factory.getbasetemp() / "loopline-cache"))
        assert main(["train", f"out_dir={run}", *JOB, *RAY]) == 0
    return run


def test_expert_parallel_run_trains_the_experts_and_replays_routes(uninterrupted: Path) -> None:
    rows = [r for r in read_metrics(uninterrupted) if "loss" in r]
    assert [r["phase"] for r in rows] == ["sft", "sft", "grpo", "grpo"]
    assert all(0 <= r["route_mismatch"] <= 1 for r in rows if r["phase"] == "grpo")
    sft, final = (
        load_file(uninterrupted / "checkpoints" / name / "model" / "model.safetensors")
        for name in ("sft-000002", FINAL)
    )
    assert final[EXPERTS].shape[0] == 128 and not torch.equal(sft[EXPERTS], final[EXPERTS])
    # the ranks' DCP shards, read whole, hold every expert as the gathered HF weights do
    dcp = read_full_state(uninterrupted / "checkpoints" / FINAL / "dcp")["model"]
    for name, weight in final.items():
        assert torch.equal(dcp[name], weight), name


@pytest.mark.heavy
def test_a_killed_expert_parallel_run_resumes_bitwise_then_on_one_rank(
    uninterrupted: Path, tmp_path: Path
) -> None:
    import ray

    run = tmp_path / "run"
    address = (
        ray.get_runtime_context().gcs_address
    )  # the killed launch joins this Ray: its actors die with it
    cmd = [sys.executable, "-m", "loopline.cli", "train", *JOB, *RAY, f"runtime.cluster.address={address}"]
    kill_at([*cmd, f"out_dir={run}"], "step:grpo:2", tmp_path / "markers", RUN_TIMEOUT_S)  # logged, not saved
    assert (run / "checkpoints" / "latest").read_text().strip() == "grpo-000001"
    assert main(["train", "--resume", *JOB, *RAY, f"out_dir={run}"]) == 0
    a, b = run / "checkpoints" / FINAL, uninterrupted / "checkpoints" / FINAL
    for name in ["model/model.safetensors", *(f"dcp/__{rank}_0.distcp" for rank in (0, 1))]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert steady(read_metrics(run)) == steady(read_metrics(uninterrupted))

    # 2 expert-parallel ranks -> 1 rank holding every expert (--resume keeps the saved config: changed explicitly)
    local = ["runtime.backend=local", "runtime.trainer_ranks=1", "runtime.trainer_ep=1"]
    assert main(["train", "--resume", *JOB, *local, "grpo.steps=3", f"out_dir={run}"]) == 0
    w2 = load_file(a / "model" / "model.safetensors")
    w3 = load_file(run / "checkpoints" / "grpo-000003" / "model" / "model.safetensors")
    step = max(float((w3[k] - w2[k]).abs().max()) for k in w2)
    assert 0 < step < 3e-3  # one AdamW step on from the expert-parallel weights, not from a fresh start


def test_the_engine_gets_every_expert_bitwise_from_the_rank_that_holds_it(ray_cluster) -> None:
    cfg = load_config(overrides=[*JOB, *RAY, "runtime.env_workers=1"])
    model, _ = load_policy(cfg.model, seed=cfg.seed)
    before = model.get_parameter(EXPERTS).detach().clone()
    roles = build_roles(cfg, model, None)  # type: ignore[arg-type]  # ray roles build their own tokenizers
    try:
        actor = roles.actor
        actor.start_phase(OptimConfig(lr=1e-2, warmup_steps=0), 4, None)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 5, 4, 2)]
        responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (6, 1, 4, 3)]
        assert actor.sft_step(collate(prompts, responses, pad_id=0), micro_batch_size=2).grad_norm > 0
        roles.rollout.update_weights(version=1)
        whole = actor.policy().state_dict()  # gathered: each expert from the rank that holds it
        assert not torch.equal(whole[EXPERTS], before)  # the step moved the experts
        engine = roles.rollout.group.call("weights")[0]
        assert engine.keys() == whole.keys()
        for name, tensor in whole.items():
            assert tensor.dtype == engine[name].dtype and torch.equal(engine[name], tensor), name
    finally:
        roles.shutdown()
