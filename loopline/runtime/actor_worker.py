"""One rank of the actor role: `ActorWorker`, the policy trainer's rank that runtime.actor's ActorRole drives.

On ray every rank is an FSDP2 rank in its own process, holding its shards, the optimizer state of those shards
and a PolicyTrainer; every call gets its data-parallel rank's slice of the batch (as the method's @dispatch
declares). With runtime.trainer_pp > 1 the ranks form a (pp, dp, tp) mesh: each holds its pipeline stages
(training.pipeline), named as in the whole model, and a PipelineTrainer; the ranks of a pipeline share their dp
rank's slice. Locally the group is one rank in this process, given the driver's model: it trains that model in
place, unsharded.

Checkpoints: every trainer rank writes its own model and optimizer shards with torch.distributed.checkpoint
(`save_state`) into the checkpoint directory (a filesystem all ranks and the driver share), and reads them
back (`load_state`) into however many ranks the resumed run has: DCP reshards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

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
from loopline.checkpoint.faults import FAULTS
from loopline.checkpoint.state import REWARD_DIR, CheckpointParts
from loopline.config import DPOConfig, OptimConfig, RewardModelConfig, RunConfig
from loopline.data.batches import RolloutBatch, TokenBatch
from loopline.data.preference import PairBatch
from loopline.distributed.dispatch import dispatch
from loopline.runtime.engine_sync import plan_params, sync_plan
from loopline.runtime.ranks import (
    frozen_logprobs,
    model_device,
    node_address,
    rank_and_world,
    rendezvous,
    seeded_model,
)
from loopline.training.critic import RewardStepStats, RewardTrainer, ScalarModel
from loopline.training.lora import MergedWeights, has_lora
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
        # test hook: a rank lost while the roles start
        FAULTS.pause_point(f"init:actor:{self.rank}", once=True)
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
        self.reward_writer = ShardWriter()  # its shards in each checkpoint of the rm phase (REWARD_DIR)

    @staticmethod
    def warm_up() -> None:
        """Import what joining the trainer's world imports (a warm process, runtime.trainer_warm, pays it ahead)."""
        import loopline.distributed.resharding
        import loopline.distributed.weight_sync
        import loopline.training.parallel  # noqa: F401

    @dispatch(gather="first")
    def rendezvous(self) -> str:
        return rendezvous(self.cfg.runtime.call_timeout_s)

    @dispatch(gather="first")
    def join(self, init_method: str) -> tuple[tuple[str, int], Any] | None:
        """Join the trainer's world (the trainer ranks only) as rank RANK and shard the model over it. Rank 0 also
        hosts the weight-sync store: it returns the store's address and the trainer layout (None elsewhere)."""
        from loopline.distributed.resharding import TrainerLayout
        from loopline.distributed.weight_sync import SyncGroup
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
        # of the whole model, in the engines' dtype (rollout.dtype): what the engines hold; the sends cast to it
        self.sync_params = plan_params(self.model, tp, self.cfg.engine_dtype)
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
            self.model = cast(
                PreTrainedModel,
                parallelize(
                    self.model, self.mesh, self.cfg.training.mixed_precision, self.cfg.runtime.trainer_ep > 1
                ),
            )
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
        from loopline.distributed.resharding import TrainerLayout
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
        from loopline.distributed.weight_sync import SyncGroup

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
            self.trainer = PolicyTrainer(
                self.model, optim, total_steps, group, loss, micro_batch_size, self.cfg.model.packing,
                self.cfg.model.share_prompts, self.cfg.model.logits_chunk_tokens,
                self.cfg.grpo.max_tokens_per_micro_batch,
                self.cfg.model.router_aux_loss_coef,
                self.cfg.grpo.routing_replay if loss is not None else None,
            )  # fmt: skip
        if resume is not None:
            self.load_state(resume.dcp)

    @dispatch(split="rows", gather="concat")
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Response log-probs of this rank's rows (a forward on every rank: FSDP2 gathers the weights)."""
        if self.stages:
            return _pipeline(self.trainer).logprobs(batch)
        model = self.cfg.model
        return frozen_logprobs(
            self.model,
            batch.to(self.device),
            model.packing,
            model.share_prompts,
            model.logits_chunk_tokens,
        ).cpu()

    @dispatch(split="rows", gather="concat")
    def behaviour_logprobs(self, batch: TokenBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows' response log-probs (b, C) from one forward without gradients: at T=1 (the loss's
        behaviour policy) and at `temperature` (what the engine reports when it samples at it)."""
        if self.stages:
            return _pipeline(self.trainer).behaviour_logprobs(batch, temperature)
        with torch.no_grad():
            trained, sampled = behaviour_logprobs(
                self.model, batch.to(self.device), temperature, self.cfg.model.packing,
                self.cfg.model.share_prompts, self.cfg.model.logits_chunk_tokens,
            )  # fmt: skip
        return trained.cpu(), sampled.cpu()

    @dispatch(
        split="rows", gather="first", train=True
    )  # the step's statistics are global: alike on every rank
    def sft_step(self, batch: TokenBatch, micro_batch_size: int, lr_scale: float = 1.0) -> SFTStepStats:
        trainer = _started(self.trainer)
        with self._fault_points("sft_step"):
            budget = self.cfg.sft.max_tokens_per_micro_batch
            stats = trainer.sft_step(batch.to(self.device), micro_batch_size, lr_scale, budget)
        self.last_stats = (trainer.updates, stats)
        return stats

    @dispatch(split="rows", gather="first", train=True)
    def policy_step(self, batch: RolloutBatch, kl_coef: float) -> PolicyStepStats:
        trainer = _started(self.trainer)
        with self._fault_points("policy_step"):
            stats = trainer.policy_step(batch.to(self.device), kl_coef)
        self.last_stats = (trainer.updates, stats)
        return stats

    @contextmanager
    def _fault_points(self, method: str, done: int | None = None) -> Iterator[None]:
        """Test hooks around this rank's next optimizer step (checkpoint.faults): a rank lost before or after it.
        done: the steps of the phase made so far (default: the policy trainer's)."""
        done = _started(self.trainer).updates if done is None else done
        point = f"{method}:{self.rank}:{done + 1}"
        FAULTS.pause_point(f"{point}:before", once=True)
        yield
        FAULTS.pause_point(f"{point}:after", once=True)

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

    @dispatch(split="any_rows", gather="concat")
    def sequence_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Summed response log-prob of each of this rank's rows, (b,), in eval mode without gradients."""
        _not_pipelined(self.stages, "DPO")
        self.model.eval()
        with torch.no_grad():
            model = self.cfg.model
            return summed_logprobs(
                self.model,
                batch.to(self.device),
                model.packing,
                model.share_prompts,
                model.logits_chunk_tokens,
            ).cpu()

    @dispatch(split="rows", gather="first", train=True)
    def dpo_step(self, pairs: PairBatch, cfg: DPOConfig) -> DPOStepStats:
        """One DPO step on this rank's pairs (they carry their reference log-probs)."""
        _not_pipelined(self.stages, "DPO")
        trainer = cast(PolicyTrainer, _started(self.trainer))
        with self._fault_points("dpo_step"):
            stats = trainer.dpo_step(pairs.to(self.device), cfg)
        self.last_stats = (trainer.updates, stats)
        return stats

    def start_reward(
        self,
        weights: Mapping[str, torch.Tensor],
        cfg: RewardModelConfig,
        total_steps: int,
        restore: str | None = None,
    ) -> None:
        """A reward model with the whole `weights` (ScalarModel.from_policy of the current policy) and its optimizer.
        The local rank copies its own policy's body (as the weights say); sharded ranks build one from the model
        config and shard it over the dp ranks (the TP ranks of a dp rank each hold the same shards). restore: a
        checkpoint's reward-model shards (weights, optimizer, LR schedule; DCP reshards) to resume from."""
        _not_pipelined(self.stages, "a reward model")
        checkpointing = self.cfg.training.activation_checkpointing
        if self.mesh is None:  # where the policy is
            model = ScalarModel.from_policy(self.model, self.cfg.model.packing, checkpointing)
            model.load_state_dict(weights)
            self.reward = RewardTrainer(model, cfg, total_steps)
        else:
            from loopline.runtime.critic import shard_critic

            shapes = seeded_model(self.cfg, rng_offset=0)[0]  # the shapes; the weights come next
            model = ScalarModel.from_policy(shapes, self.cfg.model.packing, checkpointing).to(self.device)
            model.load_state_dict(weights)
            model = shard_critic(model, self.dp_mesh)
            self.reward = RewardTrainer(model, cfg, total_steps, group=self.dp_mesh.get_group())
        if restore is not None:
            load_shards(restore, self.reward.model, self.reward, group=self.checkpoint_group)  # type: ignore[arg-type]

    @dispatch(split="rows", gather="first")  # the reward model's: no policy step
    def reward_step(self, pairs: PairBatch) -> RewardStepStats:
        """One Bradley-Terry step of the reward model on this rank's pairs."""
        reward = _reward(self.reward)
        with self._fault_points("reward_step", reward.scheduler.last_epoch):  # its steps so far (resumed too)
            return reward.step(pairs.to(self.device))

    @dispatch(split="any_rows", gather="concat")
    def reward_scores(self, batch: TokenBatch) -> torch.Tensor:
        """The reward model's score of each of this rank's rows, (b,), without gradients."""
        return _reward(self.reward).scores(batch.to(self.device)).cpu()

    @dispatch(gather="first")
    def reward_weights(self) -> dict[str, torch.Tensor] | None:
        """The reward model's whole weights on rank 0 (None elsewhere); every rank must take part."""
        from loopline.training.parallel import full_model_state

        weights = full_model_state(_reward(self.reward).model)
        return weights if self.rank == 0 else None

    def send_weights(self, targets: tuple[int, ...]) -> None:
        """This rank's part of the planned weight sync into engines `targets`: its shards straight to them."""
        from loopline.distributed.weight_sync import local_shards

        if self.trainer is not None:  # test hook: a rank lost as the sync after its n-th step begins
            FAULTS.pause_point(f"send_weights:{self.rank}:{self.trainer.updates}", once=True)
        if not self._sends_weights():
            return
        self.plan = sync_plan(self.plan, self.sync_params, self.layout, targets)
        self.sync.sync(self.plan, local_shards(self.model), None)  # pipelined: only its stages' names

    def engine_weights(self) -> Mapping[str, torch.Tensor]:
        """This rank's tensors as the in-process sync's source shards (one unsharded rank: whole, live), LoRA
        adapters folded in as each is read: the plain names and values of the engine's model."""
        return MergedWeights(self.model)  # = state_dict() without LoRA

    @dispatch(gather="first")
    def weights(self) -> dict[str, torch.Tensor] | None:
        """Whole weights on rank 0 (None elsewhere); every rank must take part. Unlike state(), this leaves a
        fresh optimizer alone (gathering its state would initialise it)."""
        weights = self._whole_weights()
        return weights if self.rank == 0 else None

    @dispatch(gather="first")
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
        weights: Mapping[str, torch.Tensor] = {}
        if hf_dir and sharded:
            whole = self._whole_weights()  # a collective: every rank joins
            if (
                self.stages and self.stages[0].tied
            ):  # the head is the embeddings: saved once, as transformers does
                whole.pop("lm_head.weight", None)
            weights = whole
        state = shard_state(self.model, self.trainer)
        if hf_dir and not sharded:  # one unsharded rank: the model part of its state is the whole weights
            # with LoRA, each adapted weight merged only as it is written (MergedWeights), not a merged copy
            weights = MergedWeights(self.model) if has_lora(self.model) else state["model"]
        hf = (self.model, weights, hf_dir) if hf_dir and self.rank == 0 else None
        self.writer.save(path, state, group=self.checkpoint_group, hf=hf, blocking=blocking)
        if self.reward is not None:  # the rm phase: the reward model's shards beside the policy's
            reward = shard_state(self.reward.model, self.reward)  # type: ignore[arg-type]
            reward_dir = str(Path(path).parent / REWARD_DIR)
            self.reward_writer.save(reward_dir, reward, group=self.checkpoint_group, blocking=blocking)

    def wait_saved(self, timeout_s: float) -> None:
        # test hook: a rank lost under a save
        FAULTS.pause_point(f"wait_saved:{self.rank}:{self.writer.checkpoint}", once=True)
        self.writer.wait(timeout_s)
        self.reward_writer.wait(timeout_s)

    def load_state(self, path: str) -> None:
        """Read this rank's shards of the weights (and optimizer, once a phase started): DCP reshards."""
        aliases = cast(dict, self.model.optim_aliases) if self.stages else None  # of the StageParts
        load_shards(path, self.model, self.trainer, group=self.checkpoint_group, optim_aliases=aliases)


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
