"""PPO's critic on the ray backend: FSDP2 critic ranks in a world of their own, in the actor's bundles.

On the session's one Ray (tests/conftest.py):
- 2 CriticWorkers placed in the bundles of a 2-bundle actor pool (asking no resources of their own) make
  the same values and the same update as the local critic in this process, within 1e-5;
- `loopline train` with grpo.advantage=gae, 2 trainer ranks, 1 engine runs PPO: value-loss rows, the critic's
  DCP shards (one file per rank) in each checkpoint's critic/ beside dcp/, the critic's weights move;
- a copy of that run cut back to its step-2 checkpoint and resumed with --resume repeats step 3 exactly:
  the same metrics row and bitwise the same critic and policy shards.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch

from loopline.checkpoint.dcp import read_full_state
from loopline.cli import main
from loopline.config import CriticConfig, OptimConfig, load_config
from loopline.data.batches import collate
from loopline.metrics.logger import read_metrics
from loopline.models import load_policy
from loopline.runtime.critic import CRITIC_DIR, CriticRole, CriticWorker, colocated_pool
from loopline.training.critic import ValueBatch
from tests.numerics import assert_adam_updates_close

pytestmark = pytest.mark.slow

ARGS = [
    "sft.steps=1", "sft.batch_size=4", "sft.micro_batch_size=4", "sft.eval_every=0",
    "grpo.steps=3", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.micro_batch_size=4",
    "grpo.advantage=gae", "grpo.minibatches=2", "critic.micro_batch_size=2", "critic.optim.lr=1e-3",
    # rewards that vary with the length (the overlong penalty): the critic learns. No KL, so no reference ranks
    # to start (KL in the reward with a critic: tests/loops/test_resume_rl_state.py)
    "grpo.overlong_buffer=6", "grpo.overlong_penalty=1.0",
    "critic.optim.warmup_steps=0", "grpo.eval_every=0", "grpo.entropy_coef=0.01", "data.task.num_train=8",
    "data.task.num_eval=2", "eval.num_prompts=2", "checkpoint_every=1", "checkpoint.keep_last=3",
    "progress=false", "tensorboard=false", "threads=1", "deterministic=true",
]  # fmt: skip
RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=1",
    "runtime.call_timeout_s=120",
]  # fmt: skip
CRITIC = CriticConfig(optim=OptimConfig(lr=1e-3, warmup_steps=0), value_clip=0.2, micro_batch_size=2)


def _value_batch() -> ValueBatch:
    """4 rows with uneven responses (one empty): the ranks get different token counts."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (6, 2, 5, 0)]
    t = collate(prompts, responses, pad_id=0)
    old = 0.1 * torch.randn(t.response_mask.shape, generator=g)
    return ValueBatch(
        t.input_ids, t.attention_mask, t.response_mask, old, old + torch.randn(old.shape, generator=g)
    )


def test_two_critic_ranks_in_the_actor_bundles_step_like_one(ray_cluster: None) -> None:
    from loopline.distributed.placement import PlacementConfig, PoolConfig, place_pools, remove_pools
    from loopline.distributed.workers import LocalGroup, RayGroup

    cfg = load_config(overrides=[*ARGS, *RAY])
    # the actor's pool: 2 bundles of 1 CPU on a 4-CPU cluster; the critic ranks take no CPU of their own
    placement = PlacementConfig(pools=[PoolConfig(name="actor", bundles=2)], roles={"actor": "actor"})
    pools = place_pools(placement)
    pool = colocated_pool("critic", pools["actor"], pools)
    assert pool.placement_group is pools["actor"].placement_group and pool.rank_resources() == {}
    group = RayGroup(CriticWorker, 2, role="critic", pool=pool, init_args=(cfg,), timeout_s=120)
    try:
        policy = load_policy(cfg.model, seed=cfg.seed)[0]
        local_group = LocalGroup(
            CriticWorker, role="critic", init_args=(cfg, policy)
        )  # one rank, this process
        ray_critic, local = CriticRole(group), CriticRole(local_group, sharded=False)
        for critic in (ray_critic, local):
            critic.start_phase(policy, CRITIC, 10, None, None)
        batch = _value_batch()
        torch.testing.assert_close(ray_critic.values(batch), local.values(batch), rtol=0, atol=1e-5)
        local_trainer = local_group.local().trainer
        assert local_trainer is not None
        before, lrs = {k: v.clone() for k, v in local_trainer.model.state_dict().items()}, []
        for _ in range(2):  # the zero head moves in the first step, the body in the second
            s_ray, s_local = ray_critic.step(batch), local.step(batch)
            lrs.append(s_local.lr)
            assert s_ray.loss == pytest.approx(s_local.loss, rel=1e-5, abs=1e-7)
            assert s_ray.grad_norm == pytest.approx(s_local.grad_norm, rel=1e-5)
            for key, value in s_local.extra.items():
                assert s_ray.extra[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        torch.testing.assert_close(ray_critic.values(batch), local.values(batch), rtol=0, atol=1e-5)
        # two orders of summing under AdamW: tests/numerics.py's rule (gradient-free: the ranks keep none)
        mine = local_trainer.model.state_dict()
        assert_adam_updates_close(before, mine, ray_critic.full_state(), lrs=lrs, betas=CRITIC.optim.betas)
    finally:
        group.shutdown()
        remove_pools(pools)


def _rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run) if r["phase"] == "grpo"}


@pytest.fixture(scope="module")
def ppo_run(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("ppo") / "run"
    assert main(["train", f"out_dir={run}", *ARGS, *RAY]) == 0
    return run


def test_ppo_runs_on_ray_and_checkpoints_the_critic_shards(ppo_run: Path) -> None:
    rows = _rows(ppo_run)
    assert sorted(rows) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key in ("value_loss", "value_grad_norm", "value_mean", "loss", "grad_norm"):
            assert math.isfinite(rows[step][key]), (step, key)
        assert rows[step]["value_grad_norm"] > 0
    critics = {}
    for step in (2, 3):
        ckpt = ppo_run / "checkpoints" / f"grpo-{step:06d}"
        shards = sorted(p.name for p in (ckpt / CRITIC_DIR).iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per critic rank
        assert torch.load(ckpt / "loop.pt", weights_only=False)["critic"] == {"dcp": CRITIC_DIR}
        critics[step] = read_full_state(ckpt / CRITIC_DIR)
    assert critics[3]["scheduler"]["last_epoch"] == 3 * 2  # two minibatch steps per GRPO step
    moved = max(
        float((critics[3]["model"][k] - critics[2]["model"][k]).abs().max()) for k in critics[3]["model"]
    )
    assert moved > 0


@pytest.mark.heavy
def test_ppo_on_ray_resumes_exactly(ppo_run: Path, tmp_path: Path) -> None:
    resumed = tmp_path / "run"
    shutil.copytree(ppo_run, resumed)
    checkpoints = resumed / "checkpoints"
    shutil.rmtree(checkpoints / "grpo-000003")
    (checkpoints / "latest").write_text("grpo-000002")
    assert main(["train", "--resume", f"out_dir={resumed}", *ARGS, *RAY]) == 0
    a, b = _rows(ppo_run), _rows(resumed)
    assert sorted(b) == [0, 1, 2, 3]
    skip = {k for k in a[3] if k.startswith(("time_", "rollout_tokens", "train_tokens"))}  # wall time
    assert json.dumps({k: v for k, v in b[3].items() if k not in skip}, sort_keys=True) == json.dumps(
        {k: v for k, v in a[3].items() if k not in skip}, sort_keys=True
    )
    for part in (CRITIC_DIR, "dcp"):
        one = read_full_state(ppo_run / "checkpoints" / "grpo-000003" / part)
        two = read_full_state(checkpoints / "grpo-000003" / part)
        for name, w in one["model"].items():
            assert torch.equal(two["model"][name], w), (part, name)


def test_a_ray_ppo_checkpoint_resumes_on_the_local_backend(ppo_run: Path, tmp_path: Path) -> None:
    """The 2-rank critic shards load into the one local critic (DCP reshards); the engine samples change."""
    resumed = tmp_path / "run"
    shutil.copytree(ppo_run, resumed)
    checkpoints = resumed / "checkpoints"
    shutil.rmtree(checkpoints / "grpo-000003")
    (checkpoints / "latest").write_text("grpo-000002")
    # --resume starts from the run's saved config (runtime.backend=ray, 2 trainer ranks): ask for local here
    local = ["runtime.backend=local", "runtime.trainer_ranks=1"]
    assert main(["train", "--resume", f"out_dir={resumed}", *ARGS, *local]) == 0
    assert not (checkpoints / "grpo-000003" / CRITIC_DIR).exists()  # the local critic writes no shards
    rows = _rows(resumed)
    assert sorted(rows) == [0, 1, 2, 3] and math.isfinite(rows[3]["value_loss"])
    # the local critic (whole, in loop.pt) continued the ray critic's step-2 state: its LR schedule counts the
    # 4 steps of the shards and the 2 of step 3 (a fresh critic would count 2), AdamW's step counts alike
    local3 = torch.load(checkpoints / "grpo-000003" / "loop.pt", weights_only=False)["critic"]
    assert local3["scheduler"]["last_epoch"] == 6
    assert {float(s["step"]) for s in local3["optimizer"]["state"].values()} == {6.0}
