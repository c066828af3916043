"""PPO's critic (grpo.advantage=gae): a WorkerGroup of `CriticWorker`s driven by `CriticRole`.

- local: one rank in this process, a CriticTrainer on a ScalarModel copied from the driver's policy; its whole
  state goes into the checkpoint's loop.pt.
- ray: FSDP2 ranks of the ScalarModel in a torch.distributed world of their own (not the actor's), as many as
  the actor has, placed like it: in the actor's bundles, asking for no resources of their own (as the env
  workers share theirs), or on the pool placement.roles maps "critic" to. Every call splits the batch into
  equal row slices, one per rank; the value loss is weighted by global token counts and FSDP2 sums the
  gradients, so N ranks make the same update as one. Checkpoints: every rank writes its shards (weights,
  AdamW, LR schedule) with DCP into the checkpoint's critic/ directory; loop.pt records only where they are,
  and a resumed run reads them back into however many ranks it has (DCP reshards).

Simplified: the critic is FSDP2 only (no tensor parallelism), and a checkpoint of a local critic (loop.pt)
does not resume on ray (a ray checkpoint's critic/ shards do resume on local).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import PreTrainedModel

from loopline.checkpoint.dcp import ShardWriter, load_shards, shard_state
from loopline.config import RunConfig
from loopline.data.batches import TokenBatch
from loopline.distributed.dispatch import dispatch
from loopline.distributed.workers import WorkerGroup
from loopline.models.load import load_policy
from loopline.runtime.protocols import Critic
from loopline.runtime.ranks import (
    join_sharded,
    model_device,
    rank_and_world,
    rank_device,
    rendezvous,
    setup_process,
)
from loopline.training.config import CriticConfig
from loopline.training.critic import CriticTrainer, ScalarModel, ValueBatch, ValueStepStats

if TYPE_CHECKING:
    from loopline.checkpoint.state import CheckpointActor
    from loopline.distributed.placement import Pool

CRITIC_DIR = "critic"  # the sharded critic's DCP shards, beside dcp/ in a checkpoint


def _restore_shards(saved: dict, checkpoint: str | None) -> str:
    """The directory of a checkpoint's critic shards (saved = {"dcp": its name in the checkpoint})."""
    if checkpoint is None:
        raise ValueError("the critic's state names DCP shards, but no checkpoint directory was given")
    path = Path(checkpoint) / saved["dcp"]
    if not path.is_dir():
        raise ValueError(f"the checkpoint's critic shards are missing: no directory {path}")
    return str(path)


def shard_critic(model: ScalarModel, mesh: Any) -> ScalarModel:
    """FSDP2 over the 1-D `mesh`, as the policy: each decoder layer of the body, then the root (embeddings,
    final norm, value head); gradients summed over the ranks."""
    from loopline.training.parallel import shard_model

    # shard_model finds the decoder layers by the class names the HF body lists
    model._no_split_modules = list(getattr(model.body, "_no_split_modules", None) or ())  # type: ignore[assignment]
    return cast(ScalarModel, shard_model(model, mesh))  # sharded in place: the same module


class CriticWorker:
    """One rank of the critic: its (FSDP2 shards of the) ScalarModel, their AdamW state, a CriticTrainer."""

    def __init__(self, cfg: RunConfig, policy: PreTrainedModel | None = None) -> None:
        """policy: the policy in this process, whose body the critic copies as it starts (the local one-rank
        group); None: this rank builds the model itself and takes the weights it is given."""
        self.cfg = cfg
        self.rank, self.ranks = rank_and_world()
        if policy is None:
            setup_process(cfg)
        self.policy = policy
        self.mesh: Any = None  # the critic ranks' DeviceMesh, once joined (None: one unsharded rank)
        self.checkpoint_group: Any = None  # DCP's own group (an async save runs it in a thread), once joined
        self.trainer: CriticTrainer | None = None
        self.writer = ShardWriter()

    @dispatch(gather="first")
    def rendezvous(self) -> str:
        return rendezvous(self.cfg.runtime.call_timeout_s)

    def join(self, init_method: str) -> None:
        """Join the critic's own world (the critic ranks only) as rank RANK."""
        self.mesh, self.checkpoint_group = join_sharded(init_method, self.cfg.runtime.call_timeout_s)

    def start_phase(
        self,
        weights: dict[str, torch.Tensor],
        cfg: CriticConfig,
        total_steps: int,
        restore: str | None,
        whole: dict | None = None,
    ) -> None:
        """The ScalarModel with the driver's whole `weights` (sharded over the ranks); a new optimizer; a resumed
        phase reads its shards from `restore` (a DCP directory, resharded to these ranks), or, on one unsharded
        rank, its `whole` state (loop.pt)."""
        if whole is not None and self.mesh is not None:
            raise ValueError(
                "this checkpoint's critic was written by the local backend (whole, in loop.pt); the ray critic "
                "resumes from DCP shards only: resume it with runtime.backend=local"
            )
        packed, checkpointing = self.cfg.model.packing, self.cfg.training.activation_checkpointing
        if self.policy is not None:
            model = ScalarModel.from_policy(self.policy, packed, checkpointing)  # where the policy is
        else:
            policy, _ = load_policy(self.cfg.model, seed=self.cfg.seed)  # the shapes; the weights come next
            model = ScalarModel.from_policy(policy, packed, checkpointing).to(rank_device())
        model.load_state_dict(weights)
        group = None
        if self.mesh is not None:
            model = shard_critic(model, self.mesh)
            group = self.mesh.get_group()
        self.trainer = CriticTrainer(model, cfg, total_steps, group=group)
        if restore is not None:
            load_shards(restore, model, self.trainer, group=self.checkpoint_group)  # type: ignore[arg-type]
        elif whole is not None:
            self.trainer.load_state_dict(whole)

    @dispatch(split="rows", gather="concat")
    def values(self, tokens: TokenBatch) -> torch.Tensor:
        """Values of this rank's rows (a forward on every rank: FSDP2 gathers the weights)."""
        trainer = _started(self.trainer)
        return trainer.values(tokens.to(model_device(trainer.model))).cpu()

    @dispatch(split="rows", gather="first")  # global statistics: alike on every rank
    def step(self, batch: ValueBatch) -> ValueStepStats:
        trainer = _started(self.trainer)
        return trainer.step(batch.to(model_device(trainer.model)))

    @dispatch(gather="first")
    def state(self) -> dict | None:
        """One unsharded rank: its whole state, for loop.pt; sharded ranks save shards instead (None)."""
        return _started(self.trainer).state_dict() if self.mesh is None else None

    def save(self, path: str, blocking: bool) -> None:
        """Write this rank's shards (weights, AdamW, LR schedule) to `path` with DCP (sharded ranks only)."""
        if self.mesh is None:
            return  # its whole state is in loop.pt
        trainer = _started(self.trainer)
        state = shard_state(trainer.model, trainer)  # type: ignore[arg-type]
        self.writer.save(path, state, group=self.checkpoint_group, blocking=blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.writer.wait(timeout_s)

    @dispatch(gather="first")
    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole weights on rank 0 (None elsewhere; every rank takes part), for checks."""
        from loopline.training.parallel import full_model_state

        weights = full_model_state(_started(self.trainer).model)
        return weights if self.rank == 0 else None


def _started(trainer: CriticTrainer | None) -> CriticTrainer:
    if trainer is None:
        raise RuntimeError("call start_phase() before using the critic")
    return trainer


class CriticRole:
    """The critic's ranks, as a WorkerGroup of CriticWorkers."""

    def __init__(self, group: WorkerGroup, sharded: bool = True) -> None:
        """group: the started CriticWorkers; `sharded` (ray): they join a world of their own here (the local rank
        holds the whole model, in no world)."""
        self.group = group
        self.started = False  # a phase started (PPO's GRPO phase): until then checkpoints hold no critic
        if sharded:
            group.call("join", group.run("rendezvous"))

    def start_phase(
        self,
        policy: PreTrainedModel,
        cfg: CriticConfig,
        total_steps: int,
        saved: dict | None,
        checkpoint: str | None,
    ) -> None:
        shards = saved is not None and "dcp" in saved
        restore = _restore_shards(saved, checkpoint) if saved is not None and shards else None
        whole = saved if saved is not None and not shards else None
        # one copy of the whole initial weights for every rank
        weights = self.group.put(ScalarModel.from_policy(policy).state_dict())
        self.group.call("start_phase", weights, cfg, total_steps, restore, whole)
        self.started = True

    def values(self, tokens: TokenBatch) -> torch.Tensor:
        return self.group.run("values", tokens)

    def step(self, batch: ValueBatch) -> ValueStepStats:
        return self.group.run("step", batch)

    def state(self) -> dict:
        whole = self.group.run("state")
        return whole if whole is not None else {"dcp": CRITIC_DIR}

    def save(self, path: str, blocking: bool) -> None:
        self.group.call("save", path, blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.group.call("wait_saved", timeout_s, timeout_s=timeout_s + 30.0)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The critic's whole weights (gathered from the ranks)."""
        return self.group.run("full_state")


def colocated_pool(role: str, actor_pool: Pool, pools: dict[str, Pool]) -> Pool:
    """Where `role`'s ranks go (a role placed like the actor): the pool placement maps it to, or else the
    actor's bundles, shared without resources of its own (they already reserve the actor's CPU/GPU)."""
    if role in pools:
        return pools[role]
    return replace(actor_pool, bundle={}, roles=(*actor_pool.roles, role))


class CheckpointWithCritic:
    """A CheckpointActor that also writes the critic's shards into each checkpoint (its critic/ directory), once
    the critic's phase has started (the SFT before it holds no critic)."""

    def __init__(self, actor: CheckpointActor, critic: Critic) -> None:
        self.actor, self.critic = actor, critic
        self._saving = False  # the save in flight includes the critic's shards

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None:
        self.actor.save_state(path, hf_dir, blocking=blocking, reference=reference)
        self._saving = self.critic.started
        if self._saving:
            self.critic.save(str(Path(path).parent / CRITIC_DIR), blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.actor.wait_saved(timeout_s)
        if self._saving:
            self.critic.wait_saved(timeout_s)

    def load_state(self, path: str) -> None:
        self.actor.load_state(path)
