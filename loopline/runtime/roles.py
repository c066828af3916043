"""The roles a loop drives, each behind a small interface, on either backend (runtime.backend).

- `Actor`, the policy trainer. local: a PolicyTrainer on the model in this process. ray: a WorkerGroup
  of `ActorWorker`s, FSDP2 ranks that each hold their shards, the optimizer state of those shards and a
  PolicyTrainer; every call splits the batch into equal row slices, one per rank.
- `Rollout`, the generation engines. local: a TorchEngine with its own copy of the weights. ray: a
  WorkerGroup of `EngineWorker`s (a whole model each); the prompts are split across them.
- `Scorer`, the task verifier. local: in this process. ray: an elastic env pool (envs.pool.WorkerPool) of
  CPU worker actors in the env pool's bundles, scoring chunks of the completions; a worker that dies or hangs
  is replaced and its chunk retried on another (bounded), and `resize` changes the workers, also mid-step.

Weight sync on ray: the trainer ranks (global ranks 0..n-1) and the engines (n..n+m-1) form one
torch.distributed world, and each step runs the planned transfer of runtime.weight_sync: every trainer
rank sends its own FSDP2 shards straight to the engines, a bucket at a time; no rank gathers the model.
Checkpoints: every trainer rank writes its own model and optimizer shards with torch.distributed.checkpoint
(`save_state`) into the checkpoint directory (a filesystem all ranks and the driver share), and reads them
back (`load_state`) into however many ranks the resumed run has: DCP reshards. The frozen reference is
sharded like the policy and saved and resharded the same way. Each engine samples from its own generator
(seeded per engine rank); the loop checkpoints the generators' states (`rng_states`) and restores them,
so a resumed ray run repeats the uninterrupted one bit for bit, as the local backend does.

Simplified: engines are TP=1 (the planner and transport handle TP>1, the engine does not yet).
"""

from __future__ import annotations

import copy
import datetime
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loopline.checkpoint.dcp import ShardWriter, load_shards, restore_trainer, shard_state
from loopline.config import ClusterConfig, GRPOConfig, OptimConfig, PlacementConfig, RunConfig, RuntimeConfig
from loopline.data.batches import RolloutBatch, TokenBatch, split_rows
from loopline.models import load_policy
from loopline.rollout.engine import Completion, SamplingParams, TorchEngine
from loopline.runtime.placement import PoolConfig
from loopline.runtime.scoring import score_chunk, score_texts
from loopline.runtime.workers import WorkerError, WorkerGroup
from loopline.training.lora import apply_lora, has_lora, merged_state_dict
from loopline.training.policy import PolicyTrainer, StepStats, response_logprobs

if TYPE_CHECKING:
    from loopline.runtime.placement import Pool

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


def build_roles(cfg: RunConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Roles:
    """The roles on cfg.runtime.backend; `model` is the policy in this process (trained by the local actor)."""
    if cfg.runtime.backend == "local":
        # The engine holds its own copy: weight sync is an explicit step, as it is across processes.
        engine = TorchEngine(copy.deepcopy(model), tokenizer)
        if cfg.model.lora.r:  # the actor trains adapters; the engine keeps a plain model, fed merged weights
            apply_lora(model, cfg.model.lora)
        return Roles(LocalActor(model), LocalRollout(engine), LocalScorer(), shutdown=lambda: None)
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
        return _logprobs(self.reference if reference else self.model, batch)

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


def _logprobs(model: PreTrainedModel | None, batch: TokenBatch) -> torch.Tensor:
    if model is None:
        raise ValueError("no reference model: start the phase with reference=True (grpo.kl_coef > 0)")
    with torch.no_grad():
        return response_logprobs(model, batch)[0]


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


def _device() -> torch.device:
    """The device a rank computes on: its GPU when Ray gave it one."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _to(batch: B, device: torch.device) -> B:
    """The batch with every tensor on `device`."""
    moved = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return replace(batch, **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def _seeded_model(cfg: RunConfig, rng_offset: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The run's initial policy (the same on every rank), with this process's torch RNG seeded."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed + rng_offset)
    model, tokenizer = load_policy(cfg.model, seed=cfg.seed)
    return model.to(_device()), tokenizer


class ActorWorker:
    """One FSDP2 rank of the policy trainer: its shards, their optimizer state, a PolicyTrainer."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.rank, self.ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.model, _ = _seeded_model(cfg, rng_offset=0)
        self.mesh: Any = None  # the trainer ranks' DeviceMesh, once joined
        self.plan: Any = None  # the weight-sync TransferPlan, once joined
        self.trainer: PolicyTrainer | None = None
        self.reference: PreTrainedModel | None = None
        self.writer = ShardWriter()
        self.checkpoint_group: Any = None  # the trainer ranks' own group for checkpoint I/O, once joined

    def rendezvous(self) -> str:
        """Address of the world's TCP store: rank 0's node and a port that was free there (WorkerGroup)."""
        return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"

    def join(self, init_method: str, world_size: int, engines: int) -> None:
        """Join the world as global rank RANK, shard the model over the trainer ranks, plan the weight sync."""
        from loopline.runtime.resharding import EngineLayout, TrainerLayout, plan_transfers
        from loopline.runtime.weight_sync import param_specs
        from loopline.training.parallel import init_distributed, shard_model, trainer_mesh

        device = init_distributed(init_method, self.rank, world_size, self.cfg.runtime.call_timeout_s)
        self.mesh = trainer_mesh(self.ranks, device.type)
        self.model = shard_model(self.model, self.mesh)
        self.plan = plan_transfers(param_specs(self.model), TrainerLayout(self.ranks), EngineLayout(engines))
        # DCP's collectives get a group of their own: an async save runs them in a thread beside training's
        self.checkpoint_group = torch.distributed.new_group(
            list(range(self.ranks)),
            backend="gloo",
            timeout=datetime.timedelta(seconds=self.cfg.runtime.call_timeout_s),
            use_local_synchronization=True,
        )

    def start_phase(
        self, optim: OptimConfig, total_steps: int, trainer_state: dict | None, reference: bool
    ) -> None:
        """New optimizer over this rank's shards (restored from the whole trainer_state); a frozen reference."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        from loopline.training.parallel import shard_model

        self.trainer = PolicyTrainer(self.model, optim, total_steps, group=self.mesh.get_group())
        if trainer_state:
            restore_trainer(self.trainer, trainer_state, group=self.checkpoint_group)
        self.reference = None
        if reference:  # a second model sharded alike, holding a copy of this rank's shards
            frozen = shard_model(load_policy(self.cfg.model, seed=self.cfg.seed)[0].to(_device()), self.mesh)
            set_model_state_dict(frozen, get_model_state_dict(self.model))
            self.reference = frozen.eval().requires_grad_(False)
            if trainer_state and "reference" in trainer_state:  # a resumed phase: its reference, resharded
                load_shards(trainer_state["reference"], self.reference, group=self.checkpoint_group)

    def logprobs(self, batch: TokenBatch, reference: bool) -> torch.Tensor:
        """Response log-probs of this rank's rows (a forward on every rank: FSDP2 gathers the weights)."""
        return _logprobs(self.reference if reference else self.model, _to(batch, _device())).cpu()

    def sft_step(self, batch: TokenBatch, micro_batch_size: int) -> StepStats:
        return _started(self.trainer).sft_step(_to(batch, _device()), micro_batch_size)

    def grpo_step(self, batch: RolloutBatch, cfg: GRPOConfig) -> StepStats:
        return _started(self.trainer).grpo_step(_to(batch, _device()), cfg, None)

    def send_weights(self) -> None:
        """This rank's part of the planned weight sync: its shards straight to the engines that need them."""
        from loopline.runtime.weight_sync import local_shards, sync_weights

        sync_weights(self.plan, local_shards(self.model), None)

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

    def save_state(self, path: str, hf_dir: str | None, blocking: bool, reference: str | None = None) -> None:
        """Write this rank's shards (DCP); rank 0 also the whole weights to hf_dir (gathered from all); with
        `reference`, this rank's shards of the frozen reference there."""
        from loopline.training.parallel import full_model_state

        weights = full_model_state(self.model) if hf_dir else {}  # a collective: every rank takes part
        hf = (self.model, weights, hf_dir) if hf_dir and self.rank == 0 else None
        state = shard_state(self.model, self.trainer)
        extra = [(reference, shard_state(_frozen(self.reference), None))] if reference else []
        self.writer.save(path, state, group=self.checkpoint_group, hf=hf, blocking=blocking, extra=extra)

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
        model, tokenizer = _seeded_model(cfg, rng_offset=1 + self.rank)
        self.engine = TorchEngine(model, tokenizer, seed=cfg.seed + 1 + self.rank)
        self.plan: Any = None  # the weight-sync TransferPlan, once joined

    def join(self, init_method: str, world_size: int, trainer_ranks: int) -> None:
        """Join the world after the trainer ranks; plan the weight sync as the trainer ranks do."""
        from loopline.runtime.resharding import EngineLayout, TrainerLayout, plan_transfers
        from loopline.runtime.weight_sync import param_specs
        from loopline.training.parallel import init_distributed, trainer_mesh

        device = init_distributed(
            init_method, trainer_ranks + self.rank, world_size, self.cfg.runtime.call_timeout_s
        )
        trainer_mesh(
            trainer_ranks, device.type
        )  # making the trainer's group is a collective of the whole world
        engines = EngineLayout(world_size - trainer_ranks)
        self.plan = plan_transfers(param_specs(self.engine.model), TrainerLayout(trainer_ranks), engines)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Completion]:
        return self.engine.generate(prompts, params, n) if prompts else []

    def receive_weights(self, version: int) -> None:
        """This engine's part of the planned weight sync: its tensors are written in place."""
        from loopline.runtime.weight_sync import engine_tensors, sync_weights

        sync_weights(self.plan, None, engine_tensors(self.engine.model))
        self.engine.version = version

    def rng_state(self) -> torch.Tensor | None:
        """This engine's sampling generator state."""
        return self.engine.rng_state()

    def set_rng_state(self, states: list[torch.Tensor | None], engines: int, reseed: int) -> bool:
        """This engine's generator from states[rank], or seeded from reseed + rank when they do not fit."""
        return _restore_engine_rng(self.engine, states, self.rank, engines, reseed)


# =========================================================================================================
# ray: the driver's side
# =========================================================================================================


def _even_slices(batch: B, ranks: int) -> list[B]:
    """`ranks` slices of equal rows (RunConfig checks that the batch sizes divide)."""
    if len(batch) % ranks:
        raise ValueError(f"a batch of {len(batch)} rows does not split evenly over {ranks} trainer ranks")
    return split_rows(batch, len(batch) // ranks)


def _chunks(items: list[Any], parts: int) -> list[tuple[int, list[Any]]]:
    """(offset, chunk) for `parts` contiguous chunks as even as can be (some may be empty)."""
    size = math.ceil(len(items) / parts) if items else 0
    return [(i * size, items[i * size : (i + 1) * size]) for i in range(parts)]


class RayActor:
    """The FSDP2 ranks of the policy trainer, as a WorkerGroup of ActorWorkers."""

    def __init__(self, group: WorkerGroup, model: PreTrainedModel) -> None:
        self.group = group
        self.model = model  # the driver's copy: filled with the trained weights by state()

    def start_phase(
        self, optim: OptimConfig, total_steps: int, trainer_state: dict | None, reference: bool = False
    ) -> None:
        import ray

        state = (
            ray.put(trainer_state) if trainer_state else None
        )  # one copy in the object store for all ranks
        self.group.call("start_phase", optim, total_steps, state, reference)

    def logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        slices = _even_slices(batch, self.group.world_size)
        return torch.cat(self.group.call_each("logprobs", [(s, reference) for s in slices]))

    def sft_step(self, batch: TokenBatch, micro_batch_size: int) -> StepStats:
        slices = _even_slices(batch, self.group.world_size)
        return self.group.call_each("sft_step", [(s, micro_batch_size) for s in slices])[0]  # same on all

    def grpo_step(self, batch: RolloutBatch, cfg: GRPOConfig) -> StepStats:
        slices = _even_slices(batch, self.group.world_size)
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
        self.group.call("save_state", path, hf_dir, blocking, reference)

    def wait_saved(self, timeout_s: float) -> None:
        self.group.call("wait_saved", timeout_s, timeout_s=timeout_s + 30.0)

    def load_state(self, path: str) -> None:
        self.group.call("load_state", path)


class RayRollout:
    """Rollout engines as a WorkerGroup of EngineWorkers; each generates for its share of the prompts."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        chunks = _chunks(prompts, self.group.world_size)
        per_engine = self.group.call_each("generate", [(chunk, params, n) for _, chunk in chunks])
        out = []
        for (offset, _), completions in zip(chunks, per_engine):
            for c in completions:
                c.prompt_index += offset  # an engine numbers its own prompts from 0
                out.append(c)
        return out

    def update_weights(self, actor: Actor, version: int) -> None:
        """Planned sync: trainer ranks send, engines receive, all at once (one torch.distributed world)."""
        if not isinstance(actor, RayActor):
            raise TypeError(f"ray engines take weights from a ray actor, not {type(actor).__name__}")
        sends = actor.group.call_async("send_weights")
        receives = self.group.call_async("receive_weights", version)
        actor.group.wait(sends)
        self.group.wait(receives)

    def rng_states(self) -> list[torch.Tensor | None]:
        return self.group.call("rng_state")

    def set_rng_states(self, states: list[torch.Tensor | None], reseed: int) -> bool:
        return all(self.group.call("set_rng_state", states, self.group.world_size, reseed))

    # -----------------------------------------------------------------------------------------------------
    # Elastic engines
    # -----------------------------------------------------------------------------------------------------


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
    """Start or join Ray, place the pools, start the three worker groups and wire the weight-sync world."""
    import ray

    from loopline.runtime.cluster import start_ray
    from loopline.runtime.placement import place_pools, remove_pools

    rt = cfg.runtime
    placement = rt.placement or default_placement(rt)
    started = start_ray(_local_cluster(rt.cluster, placement))
    groups: list[WorkerGroup] = []
    pools: dict[str, Pool] = {}
    scorer: RayScorer | None = None

    def shutdown() -> None:
        if scorer is not None:
            scorer.close()
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
        # Start the groups at once: a rank spends most of its start-up importing torch and transformers.
        options = {"backend": "ray", "timeout_s": rt.call_timeout_s}
        with ThreadPoolExecutor(len(workers)) as threads:
            starting = [
                threads.submit(WorkerGroup, cls, n, role=role, pool=pools[role], init_args=args, **options)
                for role, (cls, n, args) in workers.items()
            ]
        groups.extend(f.result() for f in starting if f.exception() is None)
        trainer, engines = (f.result() for f in starting)  # raises the first failure
        # One torch.distributed world for the weight sync: trainer ranks 0..n-1, then the engines.
        init = trainer.call("rendezvous")[0]
        world = rt.trainer_ranks + rt.engines
        joins = trainer.call_async("join", init, world, rt.engines)
        engine_joins = engines.call_async("join", init, world, rt.trainer_ranks)
        trainer.wait(joins)
        engines.wait(engine_joins)
    except BaseException:
        shutdown()
        raise
    return Roles(RayActor(trainer, model), RayRollout(engines), scorer, shutdown)
