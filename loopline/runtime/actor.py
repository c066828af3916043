"""The actor role: the policy trainer, as a WorkerGroup of `ActorWorker`s driven by `ActorRole`.

On ray every rank is an FSDP2 rank in its own process, holding its shards, the optimizer state of those shards
and a PolicyTrainer; every call splits the batch into equal row slices, one per data-parallel rank. With
runtime.trainer_pp > 1 the ranks form a (pp, dp, tp) mesh: each holds its pipeline stages (training.pipeline),
named as in the whole model, and a PipelineTrainer; the ranks of a pipeline share their dp rank's slice. Locally
the group is one rank in this process, given the driver's model: it trains that model in place, unsharded.

Checkpoints: every trainer rank writes its own model and optimizer shards with torch.distributed.checkpoint
(`save_state`) into the checkpoint directory (a filesystem all ranks and the driver share), and reads them
back (`load_state`) into however many ranks the resumed run has: DCP reshards. The frozen reference, when the
run has one, is a role of its own (runtime.reference) that ActorRole drives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import torch
from transformers import PreTrainedModel

from loopline.algorithms.policy_loss import PolicyLoss
from loopline.checkpoint.dcp import (
    ShardWriter,
    load_local_state,
    load_shards,
    local_state,
    shard_state,
    state_digest,
)
from loopline.checkpoint.faults import pause_point
from loopline.checkpoint.state import CheckpointParts
from loopline.config import DPOConfig, OptimConfig, RewardModelConfig, RunConfig
from loopline.data.batches import RolloutBatch, TokenBatch
from loopline.data.preference import PairBatch
from loopline.runtime.engine_sync import plan_params, sync_plan
from loopline.runtime.ranks import (
    even_slices,
    frozen_logprobs,
    model_device,
    node_address,
    rank_and_world,
    rendezvous,
    seeded_model,
    to_device,
)
from loopline.runtime.reference import ReferenceRole, ReferenceWorker
from loopline.runtime.workers import WorkerDiedError, WorkerError, WorkerGroup
from loopline.training.critic import RewardStepStats, RewardTrainer, ScalarModel
from loopline.training.lora import has_lora, merged_state_dict
from loopline.training.policy import (
    DPOStepStats,
    PolicyStepStats,
    PolicyTrainer,
    SFTStepStats,
    behaviour_logprobs,
)
from loopline.training.policy import sequence_logprobs as summed_logprobs

if TYPE_CHECKING:
    from loopline.training.pipeline import PipelineTrainer

B = TypeVar("B", bound=TokenBatch)
T = TypeVar("T")


class HealError(WorkerError):
    """A lost trainer rank could not be healed from a replica: no live rank holds its shards at the step."""


class ActorWorker:
    """One rank of the policy trainer: its model (FSDP2 shards once joined), their optimizer, a PolicyTrainer."""

    # replica_info and replica_state run beside a call stuck in a collective that a lost rank broke (a peer that
    # failed and left it does not close its connections, so gloo waits for it until the timeout): a healing
    # driver reads this rank's state, which no optimizer step has touched since that step's last collective
    concurrency_groups: ClassVar[dict[str, int]] = {"side": 1}

    def __init__(self, cfg: RunConfig, model: PreTrainedModel | None = None) -> None:
        """model: the policy in this process, trained in place (the local one-rank group); None: this rank loads
        the run's seeded initial policy in its own process."""
        self.cfg = cfg
        self.rank, self.ranks = rank_and_world()
        pause_point(f"init:actor:{self.rank}", once=True)  # test hook: a rank lost while the roles start
        self.model = model if model is not None else seeded_model(cfg, rng_offset=0)[0]
        from loopline.training.parallel import apply_activation_checkpointing

        apply_activation_checkpointing(self.model, cfg.training.activation_checkpointing)
        self.device = model_device(self.model)
        self.mesh: Any = None  # the trainer ranks' DeviceMesh, once joined (None: one unsharded rank)
        self.dp_mesh: Any = None  # its data-parallel ranks (all replicas' shards), 1-D, once joined
        # (trainer.updates after it, its stats) of the last train step: a heal reports a step its peers committed
        self.last_stats: tuple[int, Any] | None = None
        self.layout: Any = None  # the trainer's TrainerLayout (weight-sync planner), once joined
        self.sync: Any = None  # the weight-sync SyncGroup (trainer ranks + engines), once opened
        self.plan: Any = None  # the weight-sync TransferPlan of the last sync
        self.trainer: PolicyTrainer | PipelineTrainer | None = None
        self.stages: list[Any] = []  # this rank's pipeline stages (runtime.trainer_pp > 1), once joined
        self.sync_params: Any = (
            None  # the whole model's parameters as the sync planner reads them, once joined
        )
        self.writer = ShardWriter()
        self.checkpoint_group: Any = None  # the trainer ranks' own group for checkpoint I/O, once joined
        self.reward: RewardTrainer | None = (
            None  # `loopline rm`'s reward model on the policy's body, once started
        )

    @staticmethod
    def warm_up() -> None:
        """Import what joining the trainer's world imports (a warm process, runtime.trainer_warm, pays it ahead)."""
        import loopline.runtime.resharding
        import loopline.runtime.weight_sync
        import loopline.training.parallel  # noqa: F401

    def rendezvous(self) -> str:
        return rendezvous(self.cfg.runtime.call_timeout_s)

    def join(self, init_method: str) -> tuple[tuple[str, int], Any] | None:
        """Join the trainer's world (the trainer ranks only) as rank RANK and shard the model over it. Rank 0 also
        hosts the weight-sync store: it returns the store's address and the trainer layout (None elsewhere)."""
        from loopline.runtime.resharding import TrainerLayout
        from loopline.runtime.weight_sync import SyncGroup
        from loopline.training.parallel import (
            checkpoint_group,
            dp_tp_mesh,
            init_distributed,
            parallelize,
            replica_mesh,
        )

        timeout_s = self.cfg.runtime.call_timeout_s
        device = init_distributed(init_method, self.rank, self.ranks, timeout_s)
        tp = self.cfg.runtime.trainer_tp
        self.sync_params = plan_params(self.model, tp)  # of the whole model: what the engines hold
        if self.cfg.runtime.trainer_pp > 1:
            self.layout = self._split_into_stages(device.type)
        else:
            replicas = self.cfg.runtime.trainer_replicas
            if replicas > 1:  # HSDP: (rep, shard, tp), each replica a whole sharded copy
                self.mesh, self.dp_mesh = replica_mesh(self.ranks, tp, replicas, device.type)
            else:  # (dp, tp); tp=1 is FSDP2 over all the ranks
                self.mesh = dp_tp_mesh(self.ranks, tp, device.type)
                self.dp_mesh = self.mesh["dp"]
            # TP inside each group of tp ranks, FSDP2 across; in place: the same module
            self.model = cast(PreTrainedModel, parallelize(self.model, self.mesh))
            # the engines get their weights from replica 0's ranks (the others are not in the sync group)
            self.layout = TrainerLayout(fsdp=self.ranks // (replicas * tp), tp=tp)
        # DCP's collectives get a group of their own: an async save runs them in a thread beside training's
        self.checkpoint_group = checkpoint_group(self.ranks, timeout_s)
        if self.rank != 0:
            return None
        self.sync = SyncGroup.serve(node_address(), timeout_s)
        return self.sync.address, self.layout

    def _split_into_stages(self, device_type: str) -> Any:
        """Pipeline: a (pp, dp, tp) mesh; this rank keeps its stages of the model (TP, then FSDP2 inside each)
        and drops the rest. self.model becomes their StageParts, named as the whole model. Returns the layout."""
        from loopline.runtime.resharding import TrainerLayout
        from loopline.training.pipeline import (
            StageParts,
            parallelize_stages,
            pp_mesh,
            split_model,
            stage_layers,
        )

        rt = self.cfg.runtime
        pp, tp, virtual = rt.trainer_pp, rt.trainer_tp, rt.trainer_pp_virtual
        self.mesh = pp_mesh(self.ranks, pp, tp, device_type)
        num_layers = len(self.model.model.layers)
        stages = split_model(self.model, self.mesh.get_coordinate()[0], pp, virtual)
        for stage in stages:
            stage.chunk_tokens = self.cfg.model.logits_chunk_tokens
        self.stages = parallelize_stages(stages, self.mesh)
        self.model = cast(PreTrainedModel, StageParts(self.stages))  # the other stages' layers are freed
        layer_stages = tuple(
            s % pp for s, run in enumerate(stage_layers(num_layers, pp * virtual)) for _ in run
        )
        return TrainerLayout(fsdp=self.ranks // (pp * tp), tp=tp, pp=pp, layer_stages=layer_stages)

    def open_sync(self, address: tuple[str, int], generation: int, engines: int) -> None:
        """Open generation `generation` of the weight-sync group: these trainer ranks and `engines` engines."""
        from loopline.runtime.weight_sync import SyncGroup

        if not self._sends_weights():
            return
        if self.sync is None:
            self.sync = SyncGroup.connect(address, node_address(), self.cfg.runtime.call_timeout_s)
        self.sync.open(generation, self.rank, self.layout.size + engines)

    def _sends_weights(self) -> bool:
        """Whether this rank is in the weight-sync group: replica 0's ranks are (trainer_replicas > 1)."""
        return self.rank < self.layout.size

    def start_phase(
        self,
        optim: OptimConfig,
        total_steps: int,
        resume: CheckpointParts | None,
        loss: PolicyLoss | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        """New optimizer over this rank's shards (restored from the resumed checkpoint's); an RL phase's objective."""
        if self.stages:  # micro-batches: the phase's, else the RL ones (for log-probs during SFT)
            from loopline.training.pipeline import PipelineTrainer

            mbs = micro_batch_size or self.cfg.grpo.micro_batch_size
            schedule = self.cfg.runtime.trainer_pp_schedule
            self.trainer = PipelineTrainer(self.stages, self.mesh, optim, total_steps, schedule, loss, mbs)
        else:
            group = self.dp_mesh.get_group() if self.mesh is not None else None
            # a checkpointed layer cannot recompute a forward that fills a KV cache: with activation checkpointing
            # the trainer's forwards run each row whole rather than sharing its prompt's cache
            share = self.cfg.model.share_prompts and self.cfg.training.activation_checkpointing == "none"
            self.trainer = PolicyTrainer(
                self.model, optim, total_steps, group, loss, micro_batch_size, self.cfg.model.packing,
                share, self.cfg.model.logits_chunk_tokens, self.cfg.model.router_aux_loss_coef,
            )  # fmt: skip
        if resume is not None:
            self.load_state(resume.dcp)

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Response log-probs of this rank's rows (a forward on every rank: FSDP2 gathers the weights)."""
        if self.stages:
            return _pipeline(self.trainer).logprobs(batch)
        model = self.cfg.model
        return frozen_logprobs(
            self.model,
            to_device(batch, self.device),
            model.packing,
            model.share_prompts,
            model.logits_chunk_tokens,
        ).cpu()

    def behaviour_logprobs(self, batch: TokenBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows' response log-probs (b, C) from one forward without gradients: at T=1 (the loss's
        behaviour policy) and at `temperature` (what the engine reports when it samples at it)."""
        if self.stages:
            return _pipeline(self.trainer).behaviour_logprobs(batch, temperature)
        with torch.no_grad():
            trained, sampled = behaviour_logprobs(
                self.model, to_device(batch, self.device), temperature, self.cfg.model.packing,
                self.cfg.model.share_prompts, self.cfg.model.logits_chunk_tokens,
            )  # fmt: skip
        return trained.cpu(), sampled.cpu()

    def sft_step(self, batch: TokenBatch, micro_batch_size: int, lr_scale: float = 1.0) -> SFTStepStats:
        trainer = _started(self.trainer)
        with self._fault_points("sft_step"):
            stats = trainer.sft_step(to_device(batch, self.device), micro_batch_size, lr_scale)
        self.last_stats = (trainer.updates, stats)
        return stats

    def policy_step(self, batch: RolloutBatch, kl_coef: float) -> PolicyStepStats:
        trainer = _started(self.trainer)
        with self._fault_points("policy_step"):
            stats = trainer.policy_step(to_device(batch, self.device), kl_coef)
        self.last_stats = (trainer.updates, stats)
        return stats

    @contextmanager
    def _fault_points(self, method: str) -> Iterator[None]:
        """Test hooks around this rank's next optimizer step (checkpoint.faults): a rank lost before or after it."""
        point = f"{method}:{self.rank}:{_started(self.trainer).updates + 1}"
        pause_point(f"{point}:before", once=True)
        yield
        pause_point(f"{point}:after", once=True)

    # Healing from a replica (runtime.trainer_replicas > 1): a rank at the same mesh position of another replica
    # holds the same shards, so a new rank loads a live one's instead of a checkpoint.

    def replica_info(self) -> tuple[int, Any]:
        """(optimizer steps this phase's trainer took, that step's stats or None): what a healing driver compares.
        Runs beside the rank's own call (concurrency group "side"): a step whose update is done but whose call
        has not returned yet gets a moment to record its stats."""
        trainer = _started(self.trainer)
        deadline = time.monotonic() + 5.0
        while True:
            with trainer.lock:
                updates = trainer.updates
            recorded = self.last_stats is not None and self.last_stats[0] == updates
            if recorded or updates == 0 or time.monotonic() > deadline:
                return updates, self.last_stats[1] if recorded and self.last_stats else None
            time.sleep(0.01)

    def replica_state(self) -> dict[str, Any]:
        """This rank's shards of the weights and optimizer state, its LR schedule and step count, as plain tensors;
        never in the middle of an update (the trainer's lock)."""
        trainer = _started(self.trainer)
        with trainer.lock:
            shards, updates = local_state(self.model, trainer), trainer.updates
        return {"shards": shards, "updates": updates, "stats": self.last_stats}

    def replica_digest(self) -> str:
        """A hash of this rank's shards of the weights and optimizer state: equal at the same mesh position of every
        replica, as long as the replicas made the same updates."""
        return state_digest(local_state(self.model, _started(self.trainer)))

    def load_replica(self, state: dict[str, Any]) -> None:
        """Take a `replica_state` of the same mesh position (another replica's) into this rank's fresh trainer."""
        trainer = _started(self.trainer)
        load_local_state(self.model, trainer, state["shards"])
        trainer.updates, self.last_stats = state["updates"], state["stats"]

    # Preference training (loops.preference): DPO steps the policy; the reward model is a ScalarModel of its own
    # on these ranks (the policy's body, copied, + a scalar head), sharded over the dp ranks like the policy.

    def sequence_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Summed response log-prob of each of this rank's rows, (b,), in eval mode without gradients."""
        _not_pipelined(self.stages, "DPO")
        self.model.eval()
        with torch.no_grad():
            model = self.cfg.model
            return summed_logprobs(
                self.model,
                to_device(batch, self.device),
                model.packing,
                model.share_prompts,
                model.logits_chunk_tokens,
            ).cpu()

    def dpo_step(self, pairs: PairBatch, cfg: DPOConfig) -> DPOStepStats:
        """One DPO step on this rank's pairs (they carry their reference log-probs)."""
        _not_pipelined(self.stages, "DPO")
        return cast(PolicyTrainer, _started(self.trainer)).dpo_step(_pairs_to(pairs, self.device), cfg)

    def start_reward(
        self, weights: Mapping[str, torch.Tensor], cfg: RewardModelConfig, total_steps: int
    ) -> None:
        """A reward model with the whole `weights` (ScalarModel.from_policy of the current policy) and its optimizer.
        The local rank copies its own policy's body (as the weights say); sharded ranks build one from the model
        config and shard it over the dp ranks (the TP ranks of a dp rank each hold the same shards)."""
        _not_pipelined(self.stages, "a reward model")
        if self.mesh is None:
            model = ScalarModel.from_policy(self.model, self.cfg.model.packing)  # where the policy is
            model.load_state_dict(weights)
            self.reward = RewardTrainer(model, cfg, total_steps)
            return
        from loopline.runtime.critic import shard_critic

        shapes = seeded_model(self.cfg, rng_offset=0)[0]  # the shapes; the weights come next
        model = ScalarModel.from_policy(shapes, self.cfg.model.packing).to(self.device)
        model.load_state_dict(weights)
        model = shard_critic(model, self.dp_mesh)
        self.reward = RewardTrainer(model, cfg, total_steps, group=self.dp_mesh.get_group())

    def reward_step(self, pairs: PairBatch) -> RewardStepStats:
        """One Bradley-Terry step of the reward model on this rank's pairs."""
        return _reward(self.reward).step(_pairs_to(pairs, self.device))

    def reward_scores(self, batch: TokenBatch) -> torch.Tensor:
        """The reward model's score of each of this rank's rows, (b,), without gradients."""
        return _reward(self.reward).scores(to_device(batch, self.device)).cpu()

    def reward_weights(self) -> dict[str, torch.Tensor] | None:
        """The reward model's whole weights on rank 0 (None elsewhere); every rank must take part."""
        from loopline.training.parallel import full_model_state

        weights = full_model_state(_reward(self.reward).model)
        return weights if self.rank == 0 else None

    def send_weights(self, targets: tuple[int, ...]) -> None:
        """This rank's part of the planned weight sync into engines `targets`: its shards straight to them."""
        from loopline.runtime.weight_sync import local_shards

        if self.trainer is not None:  # test hook: a rank lost as the sync after its n-th step begins
            pause_point(f"send_weights:{self.rank}:{self.trainer.updates}", once=True)
        if not self._sends_weights():
            return
        self.plan = sync_plan(self.plan, self.sync_params, self.layout, targets)
        self.sync.sync(self.plan, local_shards(self.model), None)  # pipelined: only its stages' names

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """This rank's tensors as the in-process sync's source shards (one unsharded rank: whole, live), LoRA
        adapters folded in: the plain names and values of the engine's model."""
        return merged_state_dict(self.model)  # = state_dict() without LoRA

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Whole weights on rank 0 (None elsewhere); every rank must take part. Unlike state(), this leaves a
        fresh optimizer alone (gathering its state would initialise it)."""
        weights = self._whole_weights()
        return weights if self.rank == 0 else None

    def state(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """Whole weights and trainer state on rank 0 (None elsewhere); every rank must take part. A pipelined
        trainer gives no trainer state here (its checkpoints hold it)."""
        weights = self._whole_weights()
        trainer = self.trainer.state_dict() if isinstance(self.trainer, PolicyTrainer) else {}
        return (weights, trainer) if self.rank == 0 else None

    def _whole_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights by name on rank 0 (empty elsewhere): a collective over the trainer ranks."""
        from loopline.training.parallel import full_model_state
        from loopline.training.pipeline import full_pipeline_state

        return full_pipeline_state(self.stages, self.mesh) if self.stages else full_model_state(self.model)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load whole weights; this rank keeps its shards of them (pipelined: of its stages' parameters)."""
        from loopline.training.parallel import load_full_model_state

        if self.stages:
            weights = {name: weights[name] for name in self.model.state_dict()}
        load_full_model_state(self.model, weights)

    def save_state(self, path: str, hf_dir: str | None, blocking: bool) -> None:
        """Write this rank's shards (DCP); rank 0 also the whole weights to hf_dir (with LoRA, adapters folded in)."""
        sharded = self.mesh is not None
        weights = self._whole_weights() if hf_dir and sharded else {}  # a collective: every rank joins
        if (
            self.stages and self.stages[0].tied
        ):  # the head is the embeddings: saved once, as transformers does
            weights.pop("lm_head.weight", None)
        state = shard_state(self.model, self.trainer)
        if hf_dir and not sharded:  # one unsharded rank: the model part of its state is the whole weights
            weights = merged_state_dict(self.model) if has_lora(self.model) else state["model"]
        hf = (self.model, weights, hf_dir) if hf_dir and self.rank == 0 else None
        self.writer.save(path, state, group=self.checkpoint_group, hf=hf, blocking=blocking)

    def wait_saved(self, timeout_s: float) -> None:
        self.writer.wait(timeout_s)

    def load_state(self, path: str) -> None:
        """Read this rank's shards of the weights (and optimizer, once a phase started): DCP reshards."""
        aliases = cast(dict, self.model.optim_aliases) if self.stages else None  # of the StageParts
        load_shards(path, self.model, self.trainer, group=self.checkpoint_group, optim_aliases=aliases)


def heal_sources(
    live: Mapping[int, int], ranks: int, replicas: int, before: int
) -> tuple[int, dict[int, int]]:
    """Where a healed trainer's state comes from: `live` maps each live rank to the optimizer steps it took, of
    `ranks` in `replicas` replicas (rank r holds the shards of position r % (ranks / replicas)); the group had taken
    `before` steps when the failed call began. Returns (the steps of the state, position -> the live rank to copy):
    the most steps any live rank took (before + 1: the step was committed), at every position. ValueError when a
    position has no live rank at that step, or the ranks disagree beyond one step."""
    per = ranks // replicas
    top = max(live.values(), default=-1)
    if top not in (before, before + 1):
        raise ValueError(f"the live ranks' steps {dict(live)} are not {before} or {before + 1}")
    sources = {}
    for position in range(per):
        holders = [r for r, steps in sorted(live.items()) if r % per == position and steps == top]
        if not holders:
            raise ValueError(
                f"no live replica holds the shards of trainer rank {position} after step {top} (live ranks' "
                f"steps: {dict(live)})"
            )
        sources[position] = holders[0]
    return top, sources


def _started(trainer: PolicyTrainer | PipelineTrainer | None) -> PolicyTrainer | PipelineTrainer:
    if trainer is None:
        raise RuntimeError("call start_phase() before training steps")
    return trainer


def _pipeline(trainer: PolicyTrainer | PipelineTrainer | None) -> PipelineTrainer:
    if trainer is None or isinstance(trainer, PolicyTrainer):
        raise RuntimeError("call start_phase() before log-probs on a pipelined trainer")
    return trainer


def _not_pipelined(stages: list[Any], what: str) -> None:
    if stages:
        raise ValueError(f"{what} does not run through the pipeline yet: use runtime.trainer_pp=1")


def _reward(trainer: RewardTrainer | None) -> RewardTrainer:
    if trainer is None:
        raise RuntimeError("call start_reward() before reward-model steps")
    return trainer


def _pairs_to(pairs: PairBatch, device: torch.device) -> PairBatch:
    """The pairs with every tensor on `device` (their two token batches included)."""
    ref_c, ref_r = pairs.ref_chosen, pairs.ref_rejected
    return PairBatch(
        to_device(pairs.chosen, device),
        to_device(pairs.rejected, device),
        pairs.margin.to(device),
        None if ref_c is None else ref_c.to(device),
        None if ref_r is None else ref_r.to(device),
    )


def _reward_model(policy: PreTrainedModel) -> ScalarModel:
    """A ScalarModel of `policy`'s body in the driver, to carry weights: this process's torch RNG is left as it
    was (the head's init draws from it before zeroing it), so the run samples as it would without this copy."""
    with torch.random.fork_rng(devices=[]):
        return ScalarModel.from_policy(policy)


def _take_rows(batch: B, index: torch.Tensor) -> B:
    """The rows `index` of a batch (every tensor field indexed along dim 0)."""
    rows = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return replace(batch, **{k: v[index] for k, v in rows.items() if isinstance(v, torch.Tensor)})


class ActorRole:
    """The policy trainer's ranks (a WorkerGroup of ActorWorkers); the frozen reference, when the run has one, is
    a role of its own (reference.ReferenceRole) that this class drives."""

    def __init__(
        self,
        group: WorkerGroup,
        model: PreTrainedModel,
        reference: ReferenceRole | None = None,
        tp: int = 1,
        pp: int = 1,
        replicas: int = 1,
        restart: Callable[[], None] | None = None,
        heals: int = 0,
    ) -> None:
        """model: the driver's policy: the one the local rank trains, or (ray) a copy that state() fills.
        replicas, restart, heals (ray, runtime.trainer_replicas > 1): `restart` replaces every trainer rank in its
        bundle in a new world with the weight sync reopened (roles.restart_trainer); a lost rank is healed from a
        live replica through it, at most `heals` times."""
        self.group = group
        self.model = model
        self.reference = reference
        self.tp = tp  # runtime.trainer_tp: ranks i*tp .. i*tp+tp-1 split the model and share slice i
        self.pp = pp  # runtime.trainer_pp: rank (s*dp + i)*tp + j is stage s of that pipeline
        self.dp = group.world_size // (tp * pp)
        self.replicas, self.restart, self.heals_left = replicas, restart, heals if restart else 0
        self.updates = 0  # optimizer steps of the phase, as the ranks count them (PolicyTrainer.updates)
        self._phase: tuple[Any, ...] | None = (
            None  # start_phase's arguments, for healed ranks' fresh trainers
        )
        # set by the run: the checkpointer's abandon() (a save in flight lost a rank's shards), the logger's note_sum()
        self.drop_save: Callable[[], None] = lambda: None
        self.note: Callable[[dict[str, Any]], None] = lambda row: None

    def _slices(self, batch: B) -> list[B]:
        """One slice per rank: equal row slices over the dp ranks, each given to that dp rank's tp ranks, on
        every pipeline stage."""
        return [s for s in even_slices(batch, self.dp) for _ in range(self.tp)] * self.pp

    def _per_dp(self, outs: list) -> list:
        """One result per dp rank from every rank's (the ranks of a dp rank's pipeline and TP group agree)."""
        return outs[: self.dp * self.tp : self.tp]

    def start_phase(
        self,
        optim: OptimConfig,
        total_steps: int,
        resume: CheckpointParts | None,
        reference: bool = False,
        loss: PolicyLoss | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self.group.call("start_phase", optim, total_steps, resume, loss, micro_batch_size)
        self._phase, self.updates = (optim, total_steps, loss, micro_batch_size), 0
        if reference:  # the policy as the phase starts, frozen; a resumed phase reads its shards back
            restore = resume.reference if resume is not None else None
            weights = None if restore else self.group.call("weights")[0]
            self._reference().start(weights, restore)

    # ---------------------------------------------------------------------------------------------------------
    # Healing a lost rank from a live replica (runtime.trainer_replicas > 1)
    # ---------------------------------------------------------------------------------------------------------

    def guarded(self, call: Callable[[], T], train: bool = False, failure: WorkerError | None = None) -> T:
        """`call()` (calls on the trainer's ranks). When a rank is lost meanwhile and a live replica holds every
        shard, the group is healed from it and the call runs again; a train step (`train`) that the survivors had
        already committed is not run again: their stats are its result. Else the failure is raised (the caller
        restarts from the last checkpoint). failure: one `call` already met, to heal first."""
        while True:
            if failure is None:
                try:
                    out = call()
                except WorkerError as e:
                    failure = e
                else:
                    self.updates += train
                    if (
                        train
                    ):  # spares used by a restart or heal are replaced once the group has trained again
                        self.group.start_spares()
                    return out
            if not self._can_heal(failure):
                raise failure
            updates, stats = self._heal(failure)
            failure = None
            if train and updates == self.updates + 1:  # committed by the replicas that finished it
                print(
                    f"step {updates} of the phase was committed by the live replicas: taken as done",
                    flush=True,
                )
                self.updates = updates
                return cast(T, stats)
            if train:
                print(
                    f"no replica committed step {updates + 1} of the phase: it runs on the healed group",
                    flush=True,
                )

    def replicas_agree(self) -> bool | None:
        """Whether every replica holds bitwise the same shards and optimizer state as replica 0 (None: one replica)."""
        if self.replicas == 1 or self._phase is None:
            return None
        digests = self.guarded(lambda: self.group.call("replica_digest"))
        per = len(digests) // self.replicas
        return all(d == digests[r % per] for r, d in enumerate(digests))

    def _can_heal(self, failure: WorkerError) -> bool:
        return (
            self.restart is not None
            and self.heals_left > 0
            and failure.role == self.group.role
            and self._phase is not None
        )

    def _heal(self, failure: WorkerError) -> tuple[int, Any]:
        """Replace the trainer's ranks with new ones holding a live replica's state; (steps it had taken, its last
        step's stats). Raises `failure` when no rank was lost (nothing to heal) and HealError when the live ranks
        do not hold every shard at one step (then the run restarts from its last checkpoint)."""
        t0 = time.perf_counter()
        group, n = self.group, self.group.world_size
        # live ranks answer at once, even one whose call is stuck in a collective the lost rank broke
        infos = group.settle([group.submit(r, "replica_info", side=True) for r in range(n)])
        lost = [r for r, info in enumerate(infos) if isinstance(info, WorkerDiedError)]
        if not lost:
            raise failure
        live = {r: info for r, info in enumerate(infos) if not isinstance(info, WorkerError)}
        try:
            top, sources = heal_sources({r: u for r, (u, _) in live.items()}, n, self.replicas, self.updates)
        except ValueError as e:
            raise HealError(
                failure.role, failure.rank, failure.method, f"ranks {lost} were lost: {e}"
            ) from failure
        stats = live[sources[0]][1]
        if top == self.updates + 1 and stats is None:  # committed, but its call never returned its stats
            raise HealError(
                failure.role, failure.rank, failure.method, f"step {top} has no stats on its ranks"
            )
        self.heals_left -= 1
        self.drop_save()  # a checkpoint in flight lost the rank's shards: it never becomes latest
        per = n // self.replicas
        states = [group.submit(sources[p], "replica_state", side=True) for p in range(per)]
        group.made(states)  # into Ray's object store; the new ranks read them from there
        t1 = time.perf_counter()
        restart = cast(Callable[[], None], self.restart)
        restart()  # new ranks (spares first), a new world, the weight sync reopened
        t2 = time.perf_counter()
        optim, total_steps, loss, micro_batch_size = cast(tuple, self._phase)
        group.call("start_phase", optim, total_steps, None, loss, micro_batch_size)
        group.call_each("load_replica", [(states[r % per].ref,) for r in range(n)])
        seconds = time.perf_counter() - t0
        self.note({"heal_actor_s": seconds, "heals": 1})  # summed on the row of the step it healed
        print(
            f"healed the trainer from a live replica in {seconds:.2f}s (lost ranks {lost}; state of step {top} "
            f"from ranks {sorted(set(sources.values()))}: taken {t1 - t0:.2f}s, ranks replaced {t2 - t1:.2f}s, "
            f"loaded {time.perf_counter() - t2:.2f}s); no checkpoint loaded, no step trained again",
            flush=True,
        )
        return top, stats

    def _reference(self) -> ReferenceRole:
        if self.reference is None:
            raise ValueError("no reference role: the roles start one when the config has grpo.kl_coef > 0")
        return self.reference

    def logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        if reference:
            return self._reference().logprobs(batch)
        outs = self.guarded(lambda: self.group.call_each("logprobs", [(s,) for s in self._slices(batch)]))
        return torch.cat(self._per_dp(outs))

    def behaviour_logprobs(self, batch: TokenBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        args = [(s, temperature) for s in self._slices(batch)]
        outs = self.guarded(lambda: self.group.call_each("behaviour_logprobs", args))
        dp = self._per_dp(outs)
        return torch.cat([t for t, _ in dp]), torch.cat([s for _, s in dp])

    def sft_step(self, batch: TokenBatch, micro_batch_size: int, lr_scale: float = 1.0) -> SFTStepStats:
        args = [(s, micro_batch_size, lr_scale) for s in self._slices(batch)]
        return self.guarded(
            lambda: self.group.call_each("sft_step", args)[0], train=True
        )  # same on all ranks

    def policy_step(self, batch: RolloutBatch, kl_coef: float) -> PolicyStepStats:
        args = [(s, kl_coef) for s in self._slices(batch)]
        return self.guarded(lambda: self.group.call_each("policy_step", args)[0], train=True)  # same on all

    def _pair_slices(self, pairs: PairBatch) -> list[PairBatch]:
        """One slice per rank, as _slices: equal pair slices over the dp ranks."""
        dp = self.dp
        if len(pairs) % dp:
            raise ValueError(f"a batch of {len(pairs)} pairs does not split evenly over {dp} trainer ranks")
        return [s for s in pairs.micro_batches(len(pairs) // dp) for _ in range(self.tp)] * self.pp

    def _per_row(self, method: str, batch: TokenBatch) -> torch.Tensor:
        """One value per row from every rank's slice: a batch of any size (the last row repeated up to a multiple
        of the dp ranks, the repeats dropped from the result), (B,)."""
        n, dp = len(batch), self.dp
        if n % dp:
            index = torch.cat([torch.arange(n), torch.full(((-n) % dp,), n - 1)])
            batch = _take_rows(batch, index)
        outs = self.group.call_each(method, [(s,) for s in self._slices(batch)])
        return torch.cat(self._per_dp(outs))[:n]

    def sequence_logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        if reference:
            return (self._reference().logprobs(batch) * batch.response_mask).sum(dim=1)
        return self._per_row("sequence_logprobs", batch)

    def dpo_step(self, pairs: PairBatch, cfg: DPOConfig) -> DPOStepStats:
        slices = self._pair_slices(pairs)
        return self.group.call_each("dpo_step", [(s, cfg) for s in slices])[0]  # same on all ranks

    def start_reward(self, cfg: RewardModelConfig, total_steps: int) -> None:
        weights = _reward_model(self.policy()).state_dict()  # one copy for all ranks
        self.group.call("start_reward", self.group.put(weights), cfg, total_steps)

    def reward_step(self, pairs: PairBatch) -> RewardStepStats:
        slices = self._pair_slices(pairs)
        return self.group.call_each("reward_step", [(s,) for s in slices])[0]  # same on all ranks

    def reward_scores(self, batch: TokenBatch) -> torch.Tensor:
        return self._per_row("reward_scores", batch)

    def reward_model(self) -> ScalarModel:
        model = _reward_model(self.model)
        model.load_state_dict(self.group.call("reward_weights")[0])
        return model

    def policy(self) -> PreTrainedModel:
        # local: the model's own tensors, unchanged
        self.model.load_state_dict(self.guarded(lambda: self.group.call("weights")[0]))
        return self.model

    def state(self) -> tuple[PreTrainedModel, dict]:
        weights, trainer_state = self.guarded(lambda: self.group.call("state")[0])
        self.model.load_state_dict(weights)
        return self.model, trainer_state

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.group.call("load_weights", self.group.put(dict(weights)))

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None:
        saves = self.group.call_async("save_state", path, hf_dir, blocking)
        if reference:  # the reference's ranks write its shards there meanwhile
            self._reference().save(reference, blocking)
        try:
            self.group.wait(saves)
        except WorkerError as e:  # healed: the healthy state is the one being saved, written again
            self.guarded(lambda: self.group.call("save_state", path, hf_dir, blocking), failure=e)

    def wait_saved(self, timeout_s: float) -> None:
        self.group.call("wait_saved", timeout_s, timeout_s=timeout_s + 30.0)
        if self.reference is not None:
            self.reference.wait_saved(timeout_s)

    def load_state(self, path: str) -> None:
        self.group.call("load_state", path)


def local_actor(model: PreTrainedModel, cfg: RunConfig | None = None) -> ActorRole:
    """The actor as the local backend runs it: one rank in this process, training `model` in place, with a
    reference rank that copies it when a phase asks for one."""
    cfg = cfg if cfg is not None else RunConfig()
    reference = ReferenceRole(WorkerGroup(ReferenceWorker, role="ref", init_args=(cfg, model)), sharded=False)
    return ActorRole(WorkerGroup(ActorWorker, role="actor", init_args=(cfg, model)), model, reference)
