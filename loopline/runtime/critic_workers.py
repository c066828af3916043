"""PPO's critic (grpo.advantage=gae) behind a small interface, on either backend.

- local: a CriticTrainer on a ScalarModel in this process; its whole state goes into the checkpoint's loop.pt.
- ray: a WorkerGroup of `CriticWorker`s, FSDP2 ranks of the ScalarModel in a torch.distributed world of their
  own (not the actor's), as many as the actor has, placed like it: in the actor's bundles, asking for no
  resources of their own (as the env workers share theirs), or on the pool placement.roles maps "critic" to.
  Every call splits the batch into equal row slices, one per rank; the value loss is weighted by global token
  counts and FSDP2 sums the gradients, so N ranks make the same update as one. Checkpoints: every rank writes
  its shards (weights, AdamW, LR schedule) with DCP into the checkpoint's critic/ directory; loop.pt records
  only where they are, and a resumed run reads them back into however many ranks it has (DCP reshards).

Simplified: the critic is FSDP2 only (no tensor parallelism), and a checkpoint of a local critic (loop.pt)
does not resume on ray (a ray checkpoint's critic/ shards do resume on local).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from transformers import PreTrainedModel

from loopline.checkpoint.dcp import ShardWriter, load_shards, shard_state
from loopline.config import CriticConfig, RunConfig
from loopline.data.batches import TokenBatch
from loopline.models import load_policy
from loopline.runtime.ranks import even_slices, rank_device, to_device
from loopline.training.critic import CriticTrainer, ScalarModel, ValueBatch
from loopline.training.policy import StepStats

if TYPE_CHECKING:
    from loopline.checkpoint.state import CheckpointActor
    from loopline.runtime.placement import Pool
    from loopline.runtime.workers import WorkerGroup

CRITIC_DIR = "critic"  # the ray critic's DCP shards, beside dcp/ in a checkpoint


class Critic(Protocol):
    """PPO's value model: values for GAE, clipped value-loss steps, and its part of a checkpoint."""

    def start_phase(
        self,
        policy: PreTrainedModel,
        cfg: CriticConfig,
        total_steps: int,
        saved: dict | None,
        checkpoint: str | None,
    ) -> None:
        """A critic from the policy's body (a copy) with a zero head, a new optimizer and LR schedule; a resumed
        phase restores `saved` (what state() returned) from the checkpoint directory `checkpoint`."""
        ...

    def values(self, tokens: TokenBatch) -> torch.Tensor:
        """Values (B, C) of the response positions, without gradients."""
        ...

    def step(self, batch: ValueBatch) -> StepStats:
        """One optimizer step of the clipped value loss (token mean over the whole batch)."""
        ...

    def state(self) -> dict:
        """What the checkpoint's loop.pt holds of the critic: its whole state, or where its shards are."""
        ...

    def save(self, path: str, blocking: bool) -> None:
        """Write the critic's shards into `path` (ray); the local critic lives in loop.pt and writes nothing."""
        ...

    def wait_saved(self, timeout_s: float) -> None: ...


def _restore_shards(saved: dict, checkpoint: str | None) -> str:
    """The directory of a checkpoint's critic shards (saved = {"dcp": its name in the checkpoint})."""
    if checkpoint is None:
        raise ValueError("the critic's state names DCP shards, but no checkpoint directory was given")
    path = Path(checkpoint) / saved["dcp"]
    if not path.is_dir():
        raise ValueError(f"the checkpoint's critic shards are missing: no directory {path}")
    return str(path)


# =========================================================================================================
# local
# =========================================================================================================


class LocalCritic:
    """A CriticTrainer in this process (its state goes whole into loop.pt)."""

    def __init__(self) -> None:
        self.trainer: CriticTrainer | None = None

    def start_phase(
        self,
        policy: PreTrainedModel,
        cfg: CriticConfig,
        total_steps: int,
        saved: dict | None,
        checkpoint: str | None,
    ) -> None:
        self.trainer = CriticTrainer(ScalarModel.from_policy(policy), cfg, total_steps)
        if saved is not None and "dcp" in saved:  # a ray run's checkpoint: its shards, gathered into one rank
            load_shards(_restore_shards(saved, checkpoint), self.trainer.model, self.trainer)  # type: ignore[arg-type]
        elif saved is not None:
            self.trainer.load_state_dict(saved)

    def values(self, tokens: TokenBatch) -> torch.Tensor:
        return _started(self.trainer).values(tokens)

    def step(self, batch: ValueBatch) -> StepStats:
        return _started(self.trainer).step(batch)

    def state(self) -> dict:
        return _started(self.trainer).state_dict()

    def save(self, path: str, blocking: bool) -> None:
        pass  # the whole state is in loop.pt

    def wait_saved(self, timeout_s: float) -> None:
        pass


def _started(trainer: CriticTrainer | None) -> CriticTrainer:
    if trainer is None:
        raise RuntimeError("call start_phase() before using the critic")
    return trainer


# =========================================================================================================
# ray: one CriticWorker per rank, and the driver's RayCritic
# =========================================================================================================


def shard_critic(model: ScalarModel, mesh: Any) -> ScalarModel:
    """FSDP2 over the 1-D `mesh`, as the policy: each decoder layer of the body, then the root (embeddings,
    final norm, value head); gradients summed over the ranks."""
    from loopline.training.parallel import shard_model

    # shard_model finds the decoder layers by the class names the HF body lists
    model._no_split_modules = list(getattr(model.body, "_no_split_modules", None) or ())  # type: ignore[assignment]
    return cast(ScalarModel, shard_model(model, mesh))  # sharded in place: the same module


class CriticWorker:
    """One FSDP2 rank of the critic: its shards of the ScalarModel, their AdamW state, a CriticTrainer."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.rank, self.ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.mesh: Any = None  # the critic ranks' DeviceMesh, once joined
        self.checkpoint_group: Any = None  # DCP's own group (an async save runs it in a thread), once joined
        self.trainer: CriticTrainer | None = None
        self.writer = ShardWriter()

    def rendezvous(self) -> str:
        """Address of this group's TCP store: rank 0's node and a port that was free there (WorkerGroup)."""
        return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"

    def join(self, init_method: str) -> None:
        """Join the critic's own world (the critic ranks only) as rank RANK."""
        from loopline.training.parallel import join_sharded_world

        self.mesh, self.checkpoint_group = join_sharded_world(
            init_method, self.rank, self.ranks, self.cfg.runtime.call_timeout_s
        )

    def start_phase(
        self, weights: dict[str, torch.Tensor], cfg: CriticConfig, total_steps: int, restore: str | None
    ) -> None:
        """The ScalarModel with the driver's whole `weights`, sharded over the ranks; a new optimizer; a resumed
        phase reads its shards from `restore` (a DCP directory, resharded to these ranks)."""
        policy, _ = load_policy(self.cfg.model, seed=self.cfg.seed)  # the shapes; the weights come next
        model = ScalarModel.from_policy(policy)
        model.load_state_dict(weights)
        model = shard_critic(model.to(rank_device()), self.mesh)
        self.trainer = CriticTrainer(model, cfg, total_steps, group=self.mesh.get_group())
        if restore is not None:
            load_shards(restore, model, self.trainer, group=self.checkpoint_group)  # type: ignore[arg-type]

    def values(self, tokens: TokenBatch) -> torch.Tensor:
        """Values of this rank's rows (a forward on every rank: FSDP2 gathers the weights)."""
        return _started(self.trainer).values(to_device(tokens, rank_device())).cpu()

    def step(self, batch: ValueBatch) -> StepStats:
        return _started(self.trainer).step(to_device(batch, rank_device()))

    def save(self, path: str, blocking: bool) -> None:
        """Write this rank's shards (weights, AdamW, LR schedule) to `path` with DCP."""
        trainer = _started(self.trainer)
        state = shard_state(trainer.model, trainer)  # type: ignore[arg-type]
        self.writer.save(path, state, group=self.checkpoint_group, blocking=blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.writer.wait(timeout_s)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole weights on rank 0 (None elsewhere; every rank takes part), for checks."""
        from loopline.training.parallel import full_model_state

        weights = full_model_state(_started(self.trainer).model)
        return weights if self.rank == 0 else None


class RayCritic:
    """The FSDP2 ranks of the critic, as a WorkerGroup of CriticWorkers in a world of their own."""

    def __init__(self, group: WorkerGroup) -> None:
        """group: the started CriticWorkers; they join their world here."""
        self.group = group
        group.call("join", group.call("rendezvous")[0])

    def start_phase(
        self,
        policy: PreTrainedModel,
        cfg: CriticConfig,
        total_steps: int,
        saved: dict | None,
        checkpoint: str | None,
    ) -> None:
        import ray

        if saved is not None and "dcp" not in saved:
            raise ValueError(
                "this checkpoint's critic was written by the local backend (whole, in loop.pt); the ray critic "
                "resumes from DCP shards only: resume it with runtime.backend=local"
            )
        restore = _restore_shards(saved, checkpoint) if saved is not None else None
        # one copy of the whole initial weights in the object store, for every rank
        weights = ray.put(ScalarModel.from_policy(policy).state_dict())
        self.group.call("start_phase", weights, cfg, total_steps, restore)

    def values(self, tokens: TokenBatch) -> torch.Tensor:
        slices = even_slices(tokens, self.group.world_size)
        return torch.cat(self.group.call_each("values", [(s,) for s in slices]))

    def step(self, batch: ValueBatch) -> StepStats:
        slices = even_slices(batch, self.group.world_size)
        return self.group.call_each("step", [(s,) for s in slices])[0]  # global statistics, the same on all

    def state(self) -> dict:
        return {"dcp": CRITIC_DIR}

    def save(self, path: str, blocking: bool) -> None:
        self.group.call("save", path, blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.group.call("wait_saved", timeout_s, timeout_s=timeout_s + 30.0)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The critic's whole weights (gathered from the ranks)."""
        return self.group.call("full_state")[0]


def colocated_pool(role: str, actor_pool: Pool, pools: dict[str, Pool]) -> Pool:
    """Where `role`'s ranks go (a role placed like the actor): the pool placement maps it to, or else the
    actor's bundles, shared without resources of its own (they already reserve the actor's CPU/GPU)."""
    if role in pools:
        return pools[role]
    return replace(actor_pool, bundle={}, roles=(*actor_pool.roles, role))


class CheckpointWithCritic:
    """A CheckpointActor that also writes the critic's shards into each checkpoint (its critic/ directory)."""

    def __init__(self, actor: CheckpointActor, critic: Critic) -> None:
        self.actor, self.critic = actor, critic

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None:
        self.actor.save_state(path, hf_dir, blocking=blocking, reference=reference)
        self.critic.save(str(Path(path).parent / CRITIC_DIR), blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.actor.wait_saved(timeout_s)
        self.critic.wait_saved(timeout_s)

    def load_state(self, path: str) -> None:
        self.actor.load_state(path)
