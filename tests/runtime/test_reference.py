"""The frozen reference on the ray backend: 2 FSDP2 ReferenceWorkers in the actor's bundles, a world of their own.

On the session's Ray (tests/conftest.py): the group frozen from whole weights gives the log-probs of the same model in this process
(within 1e-5, rows split over the ranks); its DCP shards (one file per rank) read back into a second group
started from other weights give the same log-probs again. GRPO's use of it (KL, checkpoints, exact resume)
is tested end to end in tests/runtime/test_train_ray.py.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import torch

from loopline.config import load_config
from loopline.data.batches import collate
from loopline.models import load_policy
from loopline.runtime.critic import colocated_pool
from loopline.runtime.reference import ReferenceRole, ReferenceWorker
from loopline.training.policy import response_logprobs

pytestmark = pytest.mark.slow

OVERRIDES = ["runtime.backend=ray", "runtime.trainer_ranks=2", "threads=1", "seed=4"]


def test_reference_ranks_give_the_policy_logprobs_and_read_back_their_shards(
    ray_cluster: None, tmp_path: Path
) -> None:
    from loopline.distributed.placement import PlacementConfig, PoolConfig, place_pools, remove_pools
    from loopline.distributed.workers import RayGroup

    cfg = load_config(overrides=OVERRIDES)
    pools = place_pools(
        PlacementConfig(pools=[PoolConfig(name="actor", bundles=2)], roles={"actor": "actor"})
    )
    pool = colocated_pool("ref", pools["actor"], pools)
    groups = []
    try:
        policy = load_policy(cfg.model, seed=cfg.seed)[0]
        with torch.no_grad():  # weights unlike the ones a worker builds from the config
            for p in policy.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
        responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (6, 2, 5, 0)]
        batch = collate(prompts, responses, pad_id=0)
        with torch.no_grad():
            expected = response_logprobs(policy, batch)[0]

        refs = []
        for _ in range(2):
            group = RayGroup(ReferenceWorker, 2, role="ref", pool=pool, init_args=(cfg,), timeout_s=120)
            groups.append(group)
            refs.append(ReferenceRole(group))
        first, second = refs
        first.start(policy.state_dict(), None)
        torch.testing.assert_close(first.logprobs(batch), expected, rtol=0, atol=1e-5)
        shards = tmp_path / "reference"
        first.save(str(shards), blocking=True)
        assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        second.start(None, str(shards))  # the config's initial weights, then the shards read back
        assert torch.equal(second.logprobs(batch), first.logprobs(batch))
    finally:
        for group in groups:
            group.shutdown()
        remove_pools(pools)
