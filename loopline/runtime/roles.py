"""The roles a loop drives, each behind a small interface, on either backend (runtime.backend).

- `Actor`, the policy trainer. local: a PolicyTrainer on the model in this process. ray: a WorkerGroup
  of `ActorWorker`s, FSDP2 ranks that each hold their shards, the optimizer state of those shards and a
  PolicyTrainer; every call splits the batch into equal row slices, one per rank.
- `Rollout`, the generation engines. local: a TorchEngine with its own copy of the weights. ray: a
  WorkerGroup of `EngineWorker`s (a whole model each); the prompts are split across them. An engine whose
  actor dies is replaced in its bundle, synced, and its prompts issued again; `resize` adds or removes engines.
- `Scorer`, the task verifier. local: in this process. ray: an elastic env pool (envs.pool.WorkerPool) of
  CPU worker actors in the env pool's bundles, scoring chunks of the completions; a worker that dies or hangs
  is replaced and its chunk retried on another (bounded), and `resize` changes the workers, also mid-step.
- `Critic` (PPO, grpo.advantage=gae; runtime.critic_workers) and, on ray, the frozen reference (grpo.kl_coef > 0;
  runtime.reference_workers): local, in this process (the reference inside LocalActor); ray, a WorkerGroup each
  of as many FSDP2 ranks as the actor, in a torch.distributed world of its own, placed like the actor (in its
  bundles at no resources of their own, or on the pool placement.roles maps "critic" / "ref" to).

Weight sync on ray: the trainer ranks form a torch.distributed world of their own (FSDP2, checkpoints); the
sync runs over a separate gloo group (weight_sync.SyncGroup) of the trainer ranks (ranks 0..n-1) and the
current engines (n..n+m-1), rebuilt as a new generation whenever the engines change, so engines can die,
join or leave while the trainer ranks run on. Each step runs the planned transfer of runtime.weight_sync:
every trainer rank sends its own FSDP2 shards straight to the engines, a bucket at a time; no rank gathers
the model.
Checkpoints: every trainer rank writes its own model and optimizer shards with torch.distributed.checkpoint
(`save_state`) into the checkpoint directory (a filesystem all ranks and the driver share), and reads them
back (`load_state`) into however many ranks the resumed run has: DCP reshards. The frozen reference's ranks
(and the critic's) save and reshard their shards the same way. Each engine samples from its own generator
(seeded per engine rank); the loop checkpoints the generators' states (`rng_states`) and restores them,
so a resumed ray run repeats the uninterrupted one bit for bit, as the local backend does.

Simplified: engines are TP=1 (the planner and transport handle TP>1, the engine does not yet).
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loopline.checkpoint.dcp import ShardWriter, load_shards, restore_trainer, shard_state
from loopline.config import ClusterConfig, GRPOConfig, OptimConfig, PlacementConfig, RunConfig, RuntimeConfig
from loopline.data.batches import RolloutBatch, TokenBatch
from loopline.rollout.engine import Completion, SamplingParams, TorchEngine
from loopline.runtime.placement import PoolConfig
from loopline.runtime.ranks import even_slices, frozen_logprobs, rank_device, seeded_model, to_device
from loopline.runtime.scoring import score_chunk, score_texts
from loopline.runtime.workers import WorkerDiedError, WorkerError, WorkerGroup
from loopline.training.lora import apply_lora, has_lora, merged_state_dict
from loopline.training.policy import PolicyTrainer, StepStats

if TYPE_CHECKING:
    from loopline.runtime.critic_workers import Critic
    from loopline.runtime.placement import Pool
    from loopline.runtime.reference_workers import RayReference

B = TypeVar("B", bound=TokenBatch)


class Actor(Protocol):
    """The policy trainer: updates, log-probs, and the whole model for checkpoints."""

    def start_phase(
        self, optim: OptimConfig, total_steps: int, trainer_state: dict | None, reference: bool = False
    ) -> None:
        """A new optimizer and LR schedule (restored from trainer_state); freeze a reference copy if asked:
        the policy as it is, or the reference saved in the checkpoint (trainer_state["reference"], a DCP dir)."""
        ...

    def logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        """Response log-probs (B, C) under the policy, or under the frozen reference."""
        ...

    def sft_step(self, batch: TokenBatch, micro_batch_size: int) -> StepStats: ...

    def grpo_step(self, batch: RolloutBatch, cfg: GRPOConfig) -> StepStats: ...

    def state(self) -> tuple[PreTrainedModel, dict]:
        """The whole model in this process (for a checkpoint) and the trainer state ({} before a phase)."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Set the policy's weights (e.g. from a checkpoint)."""
        ...

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None:
        """Every rank writes its model, optimizer and LR-schedule shards to `path` (DCP); with hf_dir also the
        whole weights as hf_dir/model.safetensors; with `reference` the frozen reference's shards there (DCP).
        blocking=False: copied now, written in the background."""
        ...

    def wait_saved(self, timeout_s: float) -> None:
        """Wait until the ranks' save in flight is written (raise its error, or on timeout)."""
        ...

    def load_state(self, path: str) -> None:
        """Read the weights (and, once a phase started, optimizer and LR schedule) of `path` on every rank."""
        ...


class Rollout(Protocol):
    """The generation engines: sample completions, take new weights from the actor."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]: ...

    def update_weights(self, actor: Actor, version: int) -> None: ...

    def rng_states(self) -> list[torch.Tensor | None]:
        """Each engine's sampling generator state (None: the engine samples from this process's RNG)."""
        ...

    def set_rng_states(self, states: list[torch.Tensor | None], reseed: int) -> bool:
        """Restore rng_states(); True when restored exactly, False when they do not fit these engines (then each
        generator is seeded from `reseed` and the engine rank instead)."""
        ...


class Scorer(Protocol):
    """The verifier: one reward per completion."""

    def score(self, texts: list[str], answers: list[str]) -> torch.Tensor:
        """(B,) rewards, in the order of `texts`."""
        ...

    def resize(self, workers: int) -> None:
        """Run `workers` env workers from now on (ray); takes effect within the step that is running."""
        ...

    def take_stats(self) -> dict[str, float]:
        """Counts since the last call, for the metrics row: tasks retried, workers replaced ({} if none)."""
        ...


@dataclass
class Roles:
    """The roles of one run, and how to stop them (worker groups, placement groups, the Ray it started)."""

    actor: Actor
    rollout: Rollout
    scorer: Scorer
    shutdown: Callable[[], None]
    critic: Critic | None = None  # PPO's critic (grpo.advantage=gae): in this process, or its ranks on ray


def build_roles(cfg: RunConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Roles:
    """The roles on cfg.runtime.backend; `model` is the policy in this process (trained by the local actor)."""
    if cfg.runtime.backend == "local":
        # The engine holds its own copy: weight sync is an explicit step, as it is across processes.
        engine = TorchEngine(copy.deepcopy(model), tokenizer)
        if cfg.model.lora.r:  # the actor trains adapters; the engine keeps a plain model, fed merged weights
            apply_lora(model, cfg.model.lora)
        from loopline.runtime.critic_workers import LocalCritic

        critic = LocalCritic() if cfg.grpo.advantage == "gae" else None
        return Roles(LocalActor(model), LocalRollout(engine), LocalScorer(), lambda: None, critic)
    return _ray_roles(cfg, model)


# =========================================================================================================
# local: everything in this process
# =========================================================================================================


class LocalActor:
    """PolicyTrainer on the model in this process."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.trainer: PolicyTrainer | None = None
        self.reference: PreTrainedModel | None = None
        self.writer = ShardWriter()

    def start_phase(
        self, optim: OptimConfig, total_steps: int, trainer_state: dict | None, reference: bool = False
    ) -> None:
        self.trainer = PolicyTrainer(self.model, optim, total_steps)
        if trainer_state:
            restore_trainer(self.trainer, trainer_state, group=None)
        # The reference policy is the policy as the phase starts (after SFT), frozen; a resumed phase reads it back.
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) if reference else None
        if self.reference is not None and trainer_state and "reference" in trainer_state:
            load_shards(trainer_state["reference"], self.reference)

    def logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        return frozen_logprobs(self.reference if reference else self.model, batch)

    def sft_step(self, batch: TokenBatch, micro_batch_size: int) -> StepStats:
        return _started(self.trainer).sft_step(batch, micro_batch_size)

    def grpo_step(self, batch: RolloutBatch, cfg: GRPOConfig) -> StepStats:
        return _started(self.trainer).grpo_step(batch, cfg, None)

    def state(self) -> tuple[PreTrainedModel, dict]:
        return self.model, self.trainer.state_dict() if self.trainer else {}

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(weights))

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None:
        state = shard_state(self.model, self.trainer)
        # unsharded, the model part is the whole weights; with LoRA the HF weights have the adapters folded in
        weights = merged_state_dict(self.model) if has_lora(self.model) else state["model"]
        hf = (self.model, weights, hf_dir) if hf_dir else None
        extra = [(reference, shard_state(_frozen(self.reference), None))] if reference else []
        self.writer.save(path, state, group=None, hf=hf, blocking=blocking, extra=extra)

    def wait_saved(self, timeout_s: float) -> None:
        self.writer.wait(timeout_s)

    def load_state(self, path: str) -> None:
        load_shards(path, self.model, self.trainer)


class LocalRollout:
    """One TorchEngine in this process; weight sync is an in-process copy."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        return self.engine.generate(prompts, params, n)

    def update_weights(self, actor: Actor, version: int) -> None:
        if not isinstance(actor, LocalActor):
            raise TypeError(f"a local rollout takes weights from a local actor, not {type(actor).__name__}")
        self.engine.update_weights(merged_state_dict(actor.model), version)  # = state_dict() without LoRA

    def rng_states(self) -> list[torch.Tensor | None]:
        return [self.engine.rng_state()]

    def set_rng_states(self, states: list[torch.Tensor | None], reseed: int) -> bool:
        return _restore_engine_rng(self.engine, states, 0, 1, reseed)


class LocalScorer:
    """The exact-match verifier in this process."""

    def score(self, texts: list[str], answers: list[str]) -> torch.Tensor:
        return torch.tensor(score_texts(texts, answers))

    def resize(self, workers: int) -> None:
        raise ValueError(
            "the local backend scores in this process and has no env workers to resize; use runtime.backend=ray"
        )

    def take_stats(self) -> dict[str, float]:
        return {}


def _frozen(reference: PreTrainedModel | None) -> PreTrainedModel:
    if reference is None:
        raise RuntimeError("asked to save the reference policy, but the phase was started without one")
    return reference


def _restore_engine_rng(
    engine: TorchEngine, states: list[torch.Tensor | None], rank: int, engines: int, reseed: int
) -> bool:
    """Engine `rank` of `engines`: its generator from states[rank] when the saved run had as many engines and
    both sample alike (own generator, or the process's RNG); otherwise seeded from reseed + rank. True if exact."""
    mine = engine.rng_state()
    if len(states) == engines and (states[rank] is None) == (mine is None):
        if mine is not None:
            engine.set_rng_state(states[rank])
        return True
    if mine is not None:
        engine.reseed(reseed + rank)
    return False


def _started(trainer: PolicyTrainer | None) -> PolicyTrainer:
    if trainer is None:
        raise RuntimeError("call start_phase() before training steps")
    return trainer


# =========================================================================================================
# ray: worker classes (one instance per rank, in its own process)
# =========================================================================================================


def _node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 on a loopback-only local cluster)."""
    import ray.util

    return ray.util.get_node_ip_address()


def _sync_plan(plan: Any, model: torch.nn.Module, layout: Any, targets: tuple[int, ...]) -> Any:
    """The weight-sync plan into engines `targets`: `plan` if it is that plan already, else a new one."""
    from loopline.runtime.resharding import default_tp_dim
    from loopline.runtime.weight_sync import engines_plan, param_specs
    from loopline.training.parallel import tp_param_dims

    targets = tuple(targets)
    if (
        plan is not None
        and plan.trainer == layout
        and tuple(plan.dst_ranks.reshape(-1)) == tuple(layout.size + i for i in targets)
    ):
        return plan
    rule = tp_param_dims(model) if layout.tp > 1 else default_tp_dim  # where the trainer's TP split them
    return engines_plan(param_specs(model), layout, targets, rule)


class ActorWorker:
    """One FSDP2 rank of the policy trainer: its shards, their optimizer state, a PolicyTrainer."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.rank, self.ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.model, _ = seeded_model(cfg, rng_offset=0)
        self.mesh: Any = None  # the trainer ranks' DeviceMesh, once joined
        self.layout: Any = None  # the trainer's TrainerLayout (weight-sync planner), once joined
        self.sync: Any = None  # the weight-sync SyncGroup (trainer ranks + engines), once opened
        self.plan: Any = None  # the weight-sync TransferPlan of the last sync
        self.trainer: PolicyTrainer | None = None
        self.writer = ShardWriter()
        self.checkpoint_group: Any = None  # the trainer ranks' own group for checkpoint I/O, once joined

    def rendezvous(self) -> str:
        """Address of the world's TCP store: rank 0's node and a port that was free there (WorkerGroup)."""
        return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"

    def join(self, init_method: str) -> tuple[tuple[str, int], Any] | None:
        """Join the trainer's world (the trainer ranks only) as rank RANK and shard the model over it. Rank 0 also
        hosts the weight-sync store: it returns the store's address and the trainer layout (None elsewhere)."""
        from loopline.runtime.resharding import TrainerLayout
        from loopline.runtime.weight_sync import SyncGroup
        from loopline.training.parallel import checkpoint_group, dp_tp_mesh, init_distributed, parallelize

        timeout_s = self.cfg.runtime.call_timeout_s
        device = init_distributed(init_method, self.rank, self.ranks, timeout_s)
        tp = self.cfg.runtime.trainer_tp
        self.mesh = dp_tp_mesh(self.ranks, tp, device.type)  # (dp, tp); tp=1 is FSDP2 over all the ranks
        self.model = parallelize(self.model, self.mesh)  # TP inside each group of tp ranks, FSDP2 across
        self.layout = TrainerLayout(fsdp=self.ranks // tp, tp=tp)
        # DCP's collectives get a group of their own: an async save runs them in a thread beside training's
        self.checkpoint_group = checkpoint_group(self.ranks, timeout_s)
        if self.rank != 0:
            return None
        self.sync = SyncGroup.serve(_node_address(), timeout_s)
        return self.sync.address, self.layout

    def open_sync(self, address: tuple[str, int], generation: int, engines: int) -> None:
        """Open generation `generation` of the weight-sync group: these trainer ranks and `engines` engines."""
        from loopline.runtime.weight_sync import SyncGroup

        if self.sync is None:
            self.sync = SyncGroup.connect(address, _node_address(), self.cfg.runtime.call_timeout_s)
        self.sync.open(generation, self.rank, self.ranks + engines)

    def start_phase(self, optim: OptimConfig, total_steps: int, trainer_state: dict | None) -> None:
        """New optimizer over this rank's shards (restored from the whole trainer_state)."""
        self.trainer = PolicyTrainer(self.model, optim, total_steps, group=self.mesh["dp"].get_group())
        if trainer_state:
            restore_trainer(self.trainer, trainer_state, group=self.checkpoint_group)

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Response log-probs of this rank's rows (a forward on every rank: FSDP2 gathers the weights)."""
        return frozen_logprobs(self.model, to_device(batch, rank_device())).cpu()

    def sft_step(self, batch: TokenBatch, micro_batch_size: int) -> StepStats:
        return _started(self.trainer).sft_step(to_device(batch, rank_device()), micro_batch_size)

    def grpo_step(self, batch: RolloutBatch, cfg: GRPOConfig) -> StepStats:
        return _started(self.trainer).grpo_step(to_device(batch, rank_device()), cfg, None)

    def send_weights(self, targets: tuple[int, ...]) -> None:
        """This rank's part of the planned weight sync into engines `targets`: its shards straight to them."""
        from loopline.runtime.weight_sync import local_shards

        self.plan = _sync_plan(self.plan, self.model, self.layout, targets)
        self.sync.sync(self.plan, local_shards(self.model), None)

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Whole weights on rank 0 (None elsewhere); every rank must take part. Unlike state(), this leaves a
        fresh optimizer alone (gathering its state would initialise it)."""
        from loopline.training.parallel import full_model_state

        weights = full_model_state(self.model)
        return weights if self.rank == 0 else None

    def state(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """Whole weights and trainer state on rank 0 (None elsewhere); every rank must take part."""
        from loopline.training.parallel import full_model_state

        weights = full_model_state(self.model)
        trainer = self.trainer.state_dict() if self.trainer else {}
        return (weights, trainer) if self.rank == 0 else None

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load whole weights; this rank keeps its shards of them."""
        from loopline.training.parallel import load_full_model_state

        load_full_model_state(self.model, weights)

    def save_state(self, path: str, hf_dir: str | None, blocking: bool) -> None:
        """Write this rank's shards (DCP); rank 0 also the whole weights to hf_dir (gathered from all)."""
        from loopline.training.parallel import full_model_state

        weights = full_model_state(self.model) if hf_dir else {}  # a collective: every rank takes part
        hf = (self.model, weights, hf_dir) if hf_dir and self.rank == 0 else None
        state = shard_state(self.model, self.trainer)
        self.writer.save(path, state, group=self.checkpoint_group, hf=hf, blocking=blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.writer.wait(timeout_s)

    def load_state(self, path: str) -> None:
        """Read this rank's shards of the weights (and optimizer, once a phase started): DCP reshards."""
        load_shards(path, self.model, self.trainer, group=self.checkpoint_group)


class EngineWorker:
    """One rollout engine: a TorchEngine on a whole model, filled by the planned weight sync."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.rank = int(os.environ["RANK"])
        # each engine samples from its own generator, the same for the same seed (checkpointed: rng_state)
        model, tokenizer = seeded_model(cfg, rng_offset=1 + self.rank)
        self.engine = TorchEngine(model, tokenizer, seed=cfg.seed + 1 + self.rank)
        self.sync: Any = None  # the weight-sync SyncGroup (trainer ranks + engines), once opened
        self.layout: Any = None  # the trainer's TrainerLayout, from the driver
        self.plan: Any = None  # the weight-sync TransferPlan of the last sync

    def open_sync(self, address: tuple[str, int], generation: int, trainer: Any, engines: int) -> None:
        """Open generation `generation` of the weight-sync group as its rank trainer.size + RANK (the trainer's
        ranks come first), `engines` engines in all; `trainer` is the TrainerLayout the trainer ranks plan with."""
        from loopline.runtime.weight_sync import SyncGroup

        if self.sync is None:
            self.sync = SyncGroup.connect(address, _node_address(), self.cfg.runtime.call_timeout_s)
        self.layout = trainer
        self.sync.open(generation, trainer.size + self.rank, trainer.size + engines)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Completion]:
        return self.engine.generate(prompts, params, n) if prompts else []

    def receive_weights(self, version: int, targets: tuple[int, ...]) -> None:
        """This engine's part of the planned weight sync into engines `targets`: its tensors are written in place."""
        from loopline.runtime.weight_sync import engine_tensors

        self.plan = _sync_plan(self.plan, self.engine.model, self.layout, targets)
        self.sync.sync(self.plan, None, engine_tensors(self.engine.model))
        self.engine.version = version

    def weights(self) -> dict[str, torch.Tensor]:
        """This engine's whole weights (for checks: the sync delivered the trainer's bytes)."""
        return {k: v.detach().cpu() for k, v in self.engine.model.state_dict().items()}

    def rng_state(self) -> torch.Tensor | None:
        """This engine's sampling generator state."""
        return self.engine.rng_state()

    def set_rng_state(self, states: list[torch.Tensor | None], engines: int, reseed: int) -> bool:
        """This engine's generator from states[rank], or seeded from reseed + rank when they do not fit."""
        return _restore_engine_rng(self.engine, states, self.rank, engines, reseed)


# =========================================================================================================
# ray: the driver's side
# =========================================================================================================


def _chunks(items: list[Any], parts: int) -> list[tuple[int, list[Any]]]:
    """(offset, chunk) for `parts` contiguous chunks as even as can be (some may be empty)."""
    size = math.ceil(len(items) / parts) if items else 0
    return [(i * size, items[i * size : (i + 1) * size]) for i in range(parts)]


class RayActor:
    """The FSDP2 ranks of the policy trainer, as a WorkerGroup of ActorWorkers; the frozen reference, when the
    run has one, is a group of its own (reference_workers.RayReference) that this class drives."""

    def __init__(
        self, group: WorkerGroup, model: PreTrainedModel, reference: RayReference | None = None, tp: int = 1
    ) -> None:
        self.group = group
        self.model = model  # the driver's copy: filled with the trained weights by state()
        self.reference = reference
        self.tp = tp  # runtime.trainer_tp: ranks i*tp .. i*tp+tp-1 split the model and share slice i

    def _slices(self, batch: B) -> list[B]:
        """One slice per rank: equal row slices over the dp ranks, each given to that dp rank's tp ranks."""
        return [s for s in even_slices(batch, self.group.world_size // self.tp) for _ in range(self.tp)]

    def start_phase(
        self, optim: OptimConfig, total_steps: int, trainer_state: dict | None, reference: bool = False
    ) -> None:
        import ray

        state = (
            ray.put(trainer_state) if trainer_state else None
        )  # one copy in the object store for all ranks
        self.group.call("start_phase", optim, total_steps, state)
        if reference:  # the policy as the phase starts, frozen; a resumed phase reads its shards back
            restore = (trainer_state or {}).get("reference")
            weights = None if restore else self.group.call("weights")[0]
            self._reference().start(weights, restore)

    def _reference(self) -> RayReference:
        if self.reference is None:
            raise ValueError(
                "no reference group: the ray roles start one when the config has grpo.kl_coef > 0"
            )
        return self.reference

    def logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        if reference:
            return self._reference().logprobs(batch)
        outs = self.group.call_each("logprobs", [(s,) for s in self._slices(batch)])
        return torch.cat(outs[:: self.tp])

    def sft_step(self, batch: TokenBatch, micro_batch_size: int) -> StepStats:
        slices = self._slices(batch)
        return self.group.call_each("sft_step", [(s, micro_batch_size) for s in slices])[0]  # same on all

    def grpo_step(self, batch: RolloutBatch, cfg: GRPOConfig) -> StepStats:
        slices = self._slices(batch)
        return self.group.call_each("grpo_step", [(s, cfg) for s in slices])[0]  # same on all ranks

    def state(self) -> tuple[PreTrainedModel, dict]:
        weights, trainer_state = self.group.call("state")[0]
        self.model.load_state_dict(weights)
        return self.model, trainer_state

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        import ray

        self.group.call("load_weights", ray.put(dict(weights)))

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None:
        saves = self.group.call_async("save_state", path, hf_dir, blocking)
        if reference:  # the reference's ranks write its shards there meanwhile
            self._reference().save(reference, blocking)
        self.group.wait(saves)

    def wait_saved(self, timeout_s: float) -> None:
        self.group.call("wait_saved", timeout_s, timeout_s=timeout_s + 30.0)
        if self.reference is not None:
            self.reference.wait_saved(timeout_s)

    def load_state(self, path: str) -> None:
        self.group.call("load_state", path)


class RayRollout:
    """Rollout engines as a WorkerGroup of EngineWorkers; each generates for its share of the prompts.

    The weight sync runs over a SyncGroup of the trainer ranks and the current engines, apart from the
    trainer's own world, so the engines can change while the trainer ranks keep running:
    - an engine whose actor dies (in generate or in a sync) is replaced by a new actor in its bundle, the
      sync group is rebuilt (its next generation), the current weights are synced into the new engine (same
      version) and its prompts issued again; at most `max_replacements` times, then the death is raised;
    - `resize` adds engines (free bundles of the rollout pool first, then a placement group of one bundle
      each, if the cluster has room) or removes the last ones, between steps.
    """

    def __init__(
        self,
        group: WorkerGroup,
        trainer: WorkerGroup,
        pool: Pool,
        address: tuple[str, int],
        layout: Any,
        max_replacements: int = 3,
    ) -> None:
        """group: the engines; trainer: the actor's ranks; pool: the rollout pool; address: the sync store (served
        by trainer rank 0); layout: the trainer's TrainerLayout; max_replacements: engine deaths survived."""
        self.group, self.trainer, self.pool = group, trainer, pool
        self.address, self.layout = address, layout
        self.max_replacements = max_replacements
        self.replacements = 0  # engines replaced so far
        self.version: int | None = (
            None  # policy version of the last sync (None: engines hold the initial weights)
        )
        self.generation = 0  # of the sync group
        self._own: dict[
            int, Pool
        ] = {}  # id(pool) -> a placement group of one bundle holding one added engine
        self._open_sync()

    # -----------------------------------------------------------------------------------------------------
    # The Rollout interface
    # -----------------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        chunks = _chunks(prompts, self.group.world_size)
        done: dict[int, list[Completion]] = {}
        todo = list(range(len(chunks)))
        while todo:  # a dead engine's prompts go again to its replacement; the others' results are kept
            futures = [self.group.submit(r, "generate", chunks[r][1], params, n) for r in todo]
            died = []
            for r, outcome in zip(todo, self.group.settle(futures)):
                if isinstance(outcome, WorkerDiedError):
                    died.append(r)
                elif isinstance(outcome, WorkerError):
                    raise outcome
                else:
                    done[r] = outcome
            if died:
                self._replace(died, "generate")
                self._sync(self.version, tuple(died))  # the weights the others generate with
            todo = died
        out = []
        for r, (offset, _) in enumerate(chunks):
            for c in done[r]:
                c.prompt_index += offset  # an engine numbers its own prompts from 0
                out.append(c)
        return out

    def update_weights(self, actor: Actor, version: int) -> None:
        """Planned sync: trainer ranks send, every engine receives, over the sync group."""
        if not isinstance(actor, RayActor) or actor.group is not self.trainer:
            raise TypeError(f"ray engines take weights from the run's ray actor, not {type(actor).__name__}")
        self._sync(version, tuple(range(self.group.world_size)))

    def rng_states(self) -> list[torch.Tensor | None]:
        return self.group.call("rng_state")

    def set_rng_states(self, states: list[torch.Tensor | None], reseed: int) -> bool:
        return all(self.group.call("set_rng_state", states, self.group.world_size, reseed))

    # -----------------------------------------------------------------------------------------------------
    # Elastic engines
    # -----------------------------------------------------------------------------------------------------

    @property
    def engines(self) -> int:
        """Engines running now."""
        return self.group.world_size

    def resize(self, engines: int) -> None:
        """Run `engines` engines from now on (between steps): start new ones, synced to the current weights, or
        stop the last ones. Raises PlacementError, naming the shortfall, when the cluster has no room for more."""
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        before = self.group.world_size
        if engines == before:
            return
        if engines > before:
            places = self._free_places(engines - before)
            try:
                self.group.add_ranks(places)
            except BaseException:
                self._release([p for p, _ in places])
                raise
        else:
            self._release([p for p, _ in self.group.remove_ranks(engines)])
        self._open_sync()
        self._sync(self.version, tuple(range(before, engines)))

    def close(self) -> None:
        """Release the placement groups of engines added beyond the rollout pool (the caller stops the group)."""
        from loopline.runtime.placement import remove_pools

        if self._own:
            remove_pools({str(k): p for k, p in self._own.items()})
            self._own.clear()

    # -----------------------------------------------------------------------------------------------------
    # Plumbing: the sync group, replacing dead engines, finding room for new ones
    # -----------------------------------------------------------------------------------------------------

    def _open_sync(self) -> None:
        """Every trainer rank and engine opens the next generation of the sync group (the old one is dropped)."""
        self.generation += 1
        engines = self.group.world_size
        opens = self.trainer.call_async("open_sync", self.address, self.generation, engines)
        engine_opens = self.group.call_async("open_sync", self.address, self.generation, self.layout, engines)
        self.group.wait(engine_opens)
        self.trainer.wait(opens)

    def _sync(self, version: int | None, targets: tuple[int, ...]) -> None:
        """Sync the trainer's weights into engines `targets` as `version`; an engine that dies meanwhile is
        replaced and then every engine synced again (the others may hold part of the new weights)."""
        if version is None or not targets:
            return  # before the first sync every engine, a new one too, holds the initial weights
        while True:
            sends = self.trainer.call_async("send_weights", targets)
            receives = [self.group.submit(i, "receive_weights", version, targets) for i in targets]
            received = self.group.settle(
                receives
            )  # the first: a failed rank closes its group, and the rest fail
            sent = self.trainer.settle(sends)
            died = [f.rank for f, o in zip(receives, received) if isinstance(o, WorkerDiedError)]
            trainer_died = [o for o in sent if isinstance(o, WorkerDiedError)]
            if trainer_died or not died:  # a failure that is not an engine's death is the run's
                for outcome in [*trainer_died, *sent, *received]:
                    if isinstance(outcome, WorkerError):
                        raise outcome
                break
            self._replace(died, "receive_weights")
            targets = tuple(range(self.group.world_size))
        self.version = version

    def _replace(self, ranks: list[int], method: str) -> None:
        """New actors for the dead engines `ranks`, in their bundles, and a new sync group (no sync here)."""
        start = time.perf_counter()
        for rank in ranks:
            if self.replacements >= self.max_replacements:
                raise WorkerDiedError(
                    "rollout",
                    rank,
                    method,
                    f"the engine's actor died, and all runtime.max_engine_replacements={self.max_replacements} "
                    "engine replacements of this run are used up",
                )
            self.replacements += 1
            self.group.restart_rank(rank)
        self._open_sync()
        print(
            f"rollout engine(s) {ranks} died in {method}(): replaced in {time.perf_counter() - start:.1f}s "
            f"(sync group generation {self.generation}; {self.replacements} of {self.max_replacements} "
            "replacements used)",
            flush=True,
        )

    def _free_places(self, count: int) -> list[tuple[Pool, int]]:
        """(pool, bundle) for `count` more engines: free bundles of the rollout pool, then new one-bundle pools."""
        from loopline.runtime.placement import PlacementConfig, PlacementError, PoolConfig, place_pools

        used = {b for p, b in self.group.places() if p is self.pool}
        places = [(self.pool, b) for b in range(self.pool.num_bundles) if b not in used][:count]
        share = {k: v for k, v in self.pool.rank_resources().items() if v > 0}  # what one engine takes
        try:
            while len(places) < count:
                name = f"rollout-added-{self.generation}-{len(places)}"
                conf = PlacementConfig(
                    pools=[PoolConfig(name=name, bundles=1, resources=share)], roles={"rollout": name}
                )
                pool = place_pools(conf)["rollout"]
                self._own[id(pool)] = pool
                places.append((pool, 0))
        except PlacementError as e:
            room = len(places)
            self._release([p for p, _ in places])
            raise PlacementError(
                f"cannot run {self.group.world_size + count} rollout engines ({count} more): the rollout pool "
                f"'{self.pool.name}' has {self.pool.num_bundles} bundle(s), and the cluster has room for only "
                f"{room} more engine(s) of {share}; {e}"
            ) from e
        return places

    def _release(self, pools: list[Pool]) -> None:
        """Remove the one-bundle placement groups among `pools` (bundles of the rollout pool stay reserved)."""
        from loopline.runtime.placement import remove_pools

        own = {str(id(p)): p for p in pools if self._own.pop(id(p), None) is not None}
        if own:
            remove_pools(own)


class ScoringError(WorkerError):
    """Completions left without a score: their chunk's every try died or timed out, or the verifier raised."""

    def __init__(self, detail: str) -> None:
        RuntimeError.__init__(self, f"role 'env' score(): {detail}")
        self.role, self.rank, self.method = "env", -1, "score"  # a pool task has no fixed rank


class RayScorer:
    """The verifier on an elastic pool of CPU worker actors (envs.pool.WorkerPool) in the env pool's bundles.

    A step's completions go out as chunks keyed by their offset, chunks_per_worker per worker. A
    worker that dies, or hangs past task_timeout_s, is replaced and its chunk scored again on another, at
    most max_attempts tries in all; every completion gets exactly one score, in order. Workers beyond the
    pool's bundles share them (the bundles reserve the env role's resources on the nodes placement chose).
    """

    def __init__(
        self,
        pool: Pool,
        workers: int,
        task_timeout_s: float = 60.0,
        max_attempts: int = 3,
        fn: Callable[[tuple[list[str], list[str]]], list[float]] = score_chunk,
        chunks_per_worker: int = 1,
    ) -> None:
        """fn: scores one (texts, answers) chunk in a worker (picklable; the verifier by default).

        chunks_per_worker: 1 by default, as measured (512 completions, 2 workers, local Ray): one chunk per
        worker 2.5 ms, 4 per worker 9 ms, one task per completion 830 ms. A task costs a ~2 ms round trip
        and the verifier microseconds per text, so rescoring a lost worker's whole share costs next to nothing.
        """
        from loopline.envs.pool import EnvPoolConfig, RayBundles, WorkerPool

        if "env" not in pool.roles:
            raise ValueError(f"the scorer runs on the env role's pool; pool '{pool.name}' holds {pool.roles}")
        if workers < 1 or chunks_per_worker < 1:
            raise ValueError(f"workers ({workers}) and chunks_per_worker ({chunks_per_worker}) must be >= 1")
        config = EnvPoolConfig(
            backend="ray", num_workers=workers, task_timeout_s=task_timeout_s, max_attempts=max_attempts
        )
        self.chunks_per_worker = chunks_per_worker
        self.pool = WorkerPool(fn, config, RayBundles(pool.placement_group, pool.num_bundles))
        self._retries = 0  # chunks scored again since take_stats()
        self._lost = 0  # pool.workers_lost at the last take_stats()

    def score(self, texts: list[str], answers: list[str]) -> torch.Tensor:
        if len(texts) != len(answers):
            raise ValueError(f"score(): {len(texts)} texts but {len(answers)} answers")
        size = max(1, math.ceil(len(texts) / (self.pool.num_workers * self.chunks_per_worker)))
        chunks = {i: (texts[i : i + size], answers[i : i + size]) for i in range(0, len(texts), size)}
        outcomes = self.pool.map(chunks)  # one outcome per chunk, whatever happened to the workers
        self._retries += sum(o.attempts - 1 for o in outcomes.values())
        failed = sorted(i for i, o in outcomes.items() if not o.ok)
        if failed:
            more = f" (and {len(failed) - 1} more chunks)" if len(failed) > 1 else ""
            error = outcomes[failed[0]].error
            last = min(failed[0] + size, len(texts)) - 1
            raise ScoringError(f"completions {failed[0]}..{last}{more} got no score: {error}")
        return torch.tensor([s for i in sorted(outcomes) for s in outcomes[i].value])  # (B,)

    def resize(self, workers: int) -> None:
        """Keep `workers` env workers: new ones join the running step; removed busy ones finish their chunk."""
        if workers < 1:
            raise ValueError(f"env workers must be >= 1, got {workers}")
        change = workers - self.pool.num_workers
        if change > 0:
            self.pool.add_workers(change)
        elif change < 0:
            self.pool.remove_workers(-change)

    def take_stats(self) -> dict[str, float]:
        lost = self.pool.workers_lost
        stats = {
            "score_retries": float(self._retries),
            "env_workers_replaced": float(lost - self._lost),
            "env_workers": float(self.pool.num_workers),
        }
        self._retries, self._lost = 0, lost
        return stats

    def close(self) -> None:
        """Stop the workers."""
        self.pool.close()


def default_placement(rt: RuntimeConfig) -> PlacementConfig:
    """One pool per role, a {CPU: 1} bundle per rank: trainer_ranks, engines, env_workers."""
    sizes = {"actor": rt.trainer_ranks, "rollout": rt.engines, "env": rt.env_workers}
    return PlacementConfig(
        pools=[PoolConfig(name=role, bundles=n, resources={"CPU": 1.0}) for role, n in sizes.items()],
        roles={role: role for role in sizes},
    )


def _local_cluster(cluster: ClusterConfig, placement: PlacementConfig) -> ClusterConfig:
    """A local Ray gets at least the CPUs the pools ask for: Ray's CPUs are scheduling slots, and on a
    laptop the roles share the cores (num_cpus=0 means all cores; a cluster joined by address is as it is)."""
    if cluster.address or cluster.num_cpus:
        return cluster
    wanted = math.ceil(sum(p.bundles * p.resources.get("CPU", 0.0) for p in placement.pools))
    return cluster.model_copy(update={"num_cpus": max(os.cpu_count() or 1, wanted)})


def _ray_roles(cfg: RunConfig, model: PreTrainedModel) -> Roles:
    """Start or join Ray, place the pools, start the worker groups, the trainer's world and the sync group."""
    import ray

    from loopline.runtime.cluster import start_ray
    from loopline.runtime.placement import place_pools, remove_pools

    rt = cfg.runtime
    if rt.trainer_tp > 1:  # a model without a TP plan, or sizes that do not divide: say so before Ray starts
        from loopline.training.parallel import check_tp

        check_tp(model, rt.trainer_tp)
    placement = rt.placement or default_placement(rt)
    started = start_ray(_local_cluster(rt.cluster, placement))
    groups: list[WorkerGroup] = []
    pools: dict[str, Pool] = {}
    scorer: RayScorer | None = None
    rollout: RayRollout | None = None
    critic: Critic | None = None

    def shutdown() -> None:
        if scorer is not None:
            scorer.close()
        if rollout is not None:
            rollout.close()
        for group in groups:
            group.shutdown()
        if pools:
            remove_pools(pools)
        if started:
            ray.shutdown()

    try:
        pools = place_pools(placement)
        scorer = RayScorer(pools["env"], rt.env_workers)  # its workers start in the background
        workers = {
            "actor": (ActorWorker, rt.trainer_ranks, (cfg,)),
            "rollout": (EngineWorker, rt.engines, (cfg,)),
        }
        # PPO's critic and the frozen reference (KL): as many ranks as the actor each, placed like it
        from loopline.runtime.critic_workers import CriticWorker, colocated_pool
        from loopline.runtime.reference_workers import RayReference, ReferenceWorker

        where = dict(pools)
        for role, cls, wanted in (
            ("critic", CriticWorker, cfg.grpo.advantage == "gae"),
            ("ref", ReferenceWorker, cfg.grpo.kl_coef > 0),
        ):
            if wanted:
                workers[role] = (cls, rt.trainer_ranks, (cfg,))
                where[role] = colocated_pool(role, pools["actor"], pools)
        # Start the groups at once: a rank spends most of its start-up importing torch and transformers.
        options = {"backend": "ray", "timeout_s": rt.call_timeout_s}
        with ThreadPoolExecutor(len(workers)) as threads:
            starting = [
                threads.submit(WorkerGroup, cls, n, role=role, pool=where[role], init_args=args, **options)
                for role, (cls, n, args) in workers.items()
            ]
        groups.extend(f.result() for f in starting if f.exception() is None)
        trainer, engines, *others = (f.result() for f in starting)  # raises the first failure
        more = dict(zip(list(workers)[2:], others))  # role -> group: critic, ref
        # The trainer ranks form their own world (FSDP2, checkpoints); the weight sync gets a group of its own
        # over the trainer ranks and the engines (RayRollout opens it), so the engines can change.
        address, layout = trainer.call("join", trainer.call("rendezvous")[0])[0]
        rollout = RayRollout(engines, trainer, pools["rollout"], address, layout, rt.max_engine_replacements)
        if "critic" in more:
            from loopline.runtime.critic_workers import RayCritic

            critic = RayCritic(more["critic"])  # its ranks join a world of their own
        reference = RayReference(more["ref"]) if "ref" in more else None  # so do the reference's
    except BaseException:
        shutdown()
        raise
    return Roles(RayActor(trainer, model, reference, rt.trainer_tp), rollout, scorer, shutdown, critic=critic)
