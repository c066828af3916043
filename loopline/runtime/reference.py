"""The frozen reference policy (grpo.kl_coef > 0): a WorkerGroup of `ReferenceWorker`s driven by `ReferenceRole`.

On ray the ranks are FSDP2 ranks of a frozen copy of the policy in a torch.distributed world of their own, as
many as the actor has, in the actor's bundles without resources of their own (or on the pool that
placement.roles maps "ref" to). Locally the group is one rank in this process, which copies the driver's
policy. The reference is the policy as the phase starts (its whole weights, passed once through the object
store on ray), or, in a resumed phase, the checkpoint's reference shards (DCP reshards them to these ranks).
Log-probs: every rank takes an equal row slice. Checkpoints: every rank writes its shards into the
checkpoint's reference/ directory.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from loopline.checkpoint.dcp import ShardWriter, load_shards, shard_state
from loopline.config import RunConfig
from loopline.data.batches import TokenBatch
from loopline.distributed.dispatch import dispatch
from loopline.distributed.workers import WorkerGroup
from loopline.models.load import load_policy
from loopline.runtime.ranks import (
    frozen_logprobs,
    join_sharded,
    model_device,
    rank_and_world,
    rank_device,
    rendezvous,
    setup_process,
)


class ReferenceWorker:
    """One rank of the frozen reference: its (FSDP2 shards of the) weights, log-probs of its rows."""

    def __init__(self, cfg: RunConfig, policy: PreTrainedModel | None = None) -> None:
        """policy: the policy in this process, copied as the reference starts (the local one-rank group); None:
        this rank builds the model itself and takes the weights it is given."""
        self.cfg = cfg
        self.rank, self.ranks = rank_and_world()
        if policy is None:
            setup_process(cfg)
        self.policy = policy
        self.mesh = None  # this group's DeviceMesh, once joined (None: one unsharded rank)
        self.checkpoint_group = None  # DCP's own group (an async save runs it in a thread), once joined
        self.model: PreTrainedModel | None = None
        self.writer = ShardWriter()

    @dispatch(gather="first")
    def rendezvous(self) -> str:
        return rendezvous(self.cfg.runtime.call_timeout_s)

    def join(self, init_method: str) -> None:
        """Join the reference's own world (its ranks only) as rank RANK."""
        self.mesh, self.checkpoint_group = join_sharded(init_method, self.cfg.runtime.call_timeout_s)

    def start(self, weights: dict[str, torch.Tensor] | None, restore: str | None) -> None:
        """Freeze the policy's whole `weights`, sharded over the ranks; or read the shards at `restore` (DCP)."""
        from loopline.training.parallel import shard_model

        if self.policy is not None:
            model = copy.deepcopy(self.policy)  # where the policy is, as it is
        else:
            model = load_policy(self.cfg.model, seed=self.cfg.seed)[0].to(rank_device())  # type: ignore[arg-type]
        if weights is not None:
            model.load_state_dict(weights)
        if self.mesh is not None:
            # in place: the same module; it computes as the policy does (training.mixed_precision)
            shard_model(model, self.mesh, self.cfg.training.mixed_precision)
        if restore is not None:
            load_shards(restore, model, group=self.checkpoint_group)
        self.model = model.eval().requires_grad_(False)

    @dispatch(split="rows", gather="concat")
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Response log-probs of this rank's rows under the reference (a forward on every rank)."""
        if self.model is None:
            return frozen_logprobs(None, batch)  # raises: no reference was started
        return frozen_logprobs(
            self.model, batch.to(model_device(self.model)), self.cfg.model.packing,
            self.cfg.model.share_prompts, self.cfg.model.logits_chunk_tokens,
        ).cpu()  # fmt: skip

    def save(self, path: str, blocking: bool) -> None:
        """Write this rank's shards of the reference to `path` with DCP."""
        if self.model is None:
            raise RuntimeError("asked to save the reference policy, but the phase was started without one")
        self.writer.save(path, shard_state(self.model, None), group=self.checkpoint_group, blocking=blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.writer.wait(timeout_s)


class ReferenceRole:
    """The reference's ranks, driven by the actor (actor.ActorRole)."""

    def __init__(self, group: WorkerGroup, sharded: bool = True) -> None:
        """group: the started ReferenceWorkers; `sharded` (ray): they join their world here and shard the model
        over it (the local rank holds the whole model, in no world)."""
        self.group = group
        if sharded:
            group.call("join", group.run("rendezvous"))

    def start(self, weights: dict[str, torch.Tensor] | None, restore: str | None) -> None:
        self.group.call("start", self.group.put(weights) if weights is not None else None, restore)

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        return self.group.run("logprobs", batch)

    def save(self, path: str, blocking: bool) -> None:
        self.group.call("save", path, blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.group.call("wait_saved", timeout_s, timeout_s=timeout_s + 30.0)
