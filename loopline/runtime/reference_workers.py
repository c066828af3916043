"""The frozen reference policy on the ray backend: a group of its own, placed like the actor.

`ReferenceWorker`s are FSDP2 ranks of a frozen copy of the policy in a torch.distributed world of their own,
as many as the actor has, in the actor's bundles without resources of their own (or on the pool that
placement.roles maps "ref" to). The reference is the policy as the phase starts (its whole weights, passed
once through the object store), or, in a resumed phase, the checkpoint's reference shards (DCP reshards them
to these ranks). Log-probs: every rank takes an equal row slice. Checkpoints: every rank writes its shards
into the checkpoint's reference/ directory, as the actor ranks wrote them before the reference moved out.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from loopline.checkpoint.dcp import ShardWriter, load_shards, shard_state
from loopline.config import RunConfig
from loopline.data.batches import TokenBatch
from loopline.models import load_policy
from loopline.runtime.ranks import even_slices, frozen_logprobs, rank_device, to_device

if TYPE_CHECKING:
    from loopline.runtime.workers import WorkerGroup


class ReferenceWorker:
    """One FSDP2 rank of the frozen reference: its shards of the weights, log-probs of its rows."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.rank, self.ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.mesh: Any = None  # this group's DeviceMesh, once joined
        self.checkpoint_group: Any = None  # DCP's own group (an async save runs it in a thread), once joined
        self.model: PreTrainedModel | None = None
        self.writer = ShardWriter()

    def rendezvous(self) -> str:
        """Address of this group's TCP store: rank 0's node and a port that was free there (WorkerGroup)."""
        return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"

    def join(self, init_method: str) -> None:
        """Join the reference's own world (its ranks only) as rank RANK."""
        from loopline.training.parallel import join_sharded_world

        self.mesh, self.checkpoint_group = join_sharded_world(
            init_method, self.rank, self.ranks, self.cfg.runtime.call_timeout_s
        )

    def start(self, weights: dict[str, torch.Tensor] | None, restore: str | None) -> None:
        """Freeze the policy's whole `weights`, sharded over the ranks; or read the shards at `restore` (DCP)."""
        from loopline.training.parallel import shard_model

        model = load_policy(self.cfg.model, seed=self.cfg.seed)[0]
        if weights is not None:
            model.load_state_dict(weights)
        model = shard_model(model.to(rank_device()), self.mesh)  # type: ignore[arg-type,assignment]
        if restore is not None:
            load_shards(restore, model, group=self.checkpoint_group)
        self.model = model.eval().requires_grad_(False)

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Response log-probs of this rank's rows under the reference (a forward on every rank)."""

        return frozen_logprobs(self.model, to_device(batch, rank_device())).cpu()

    def save(self, path: str, blocking: bool) -> None:
        """Write this rank's shards of the reference to `path` with DCP."""
        if self.model is None:
            raise RuntimeError("asked to save the reference policy, but none was started")
        self.writer.save(path, shard_state(self.model, None), group=self.checkpoint_group, blocking=blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.writer.wait(timeout_s)


class RayReference:
    """The reference's ranks, driven by the ray actor (RayActor)."""

    def __init__(self, group: WorkerGroup) -> None:
        """group: the started ReferenceWorkers; they join their world here."""
        self.group = group
        group.call("join", group.call("rendezvous")[0])

    def start(self, weights: dict[str, torch.Tensor] | None, restore: str | None) -> None:
        import ray

        self.group.call("start", ray.put(weights) if weights is not None else None, restore)

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:

        slices = even_slices(batch, self.group.world_size)
        return torch.cat(self.group.call_each("logprobs", [(s,) for s in slices]))

    def save(self, path: str, blocking: bool) -> None:
        self.group.call("save", path, blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.group.call("wait_saved", timeout_s, timeout_s=timeout_s + 30.0)
