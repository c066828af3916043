"""The actor role: the policy trainer's ranks (a WorkerGroup of runtime.actor_worker's `ActorWorker`s) driven by
`ActorRole`.

Each call goes to the ranks as the worker method's @dispatch declares (distributed.dispatch: the batch split in equal
row slices over the data-parallel ranks, the results taken from rank 0 or concatenated), through one recovery
guard (`ActorRole.guarded`): with runtime.trainer_replicas > 1 a lost rank is healed from a live replica and the
call runs again. The frozen reference, when the run has one, is a role of its own (runtime.reference) that
ActorRole drives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from transformers import PreTrainedModel

from loopline.algorithms.policy_loss import PolicyLoss
from loopline.checkpoint.state import CheckpointParts
from loopline.config import DPOConfig, OptimConfig, RewardModelConfig, RunConfig
from loopline.data.batches import RolloutBatch, TokenBatch
from loopline.data.preference import PairBatch
from loopline.distributed.dispatch import rule_of
from loopline.distributed.workers import LocalGroup, WorkerDiedError, WorkerError, WorkerGroup
from loopline.runtime.actor_worker import ActorWorker
from loopline.runtime.recovery import Recovery
from loopline.runtime.reference import ReferenceRole, ReferenceWorker
from loopline.training.critic import RewardStepStats, ScalarModel
from loopline.training.policy import (
    DPOStepStats,
    PolicyStepStats,
    SFTStepStats,
)

T = TypeVar("T")


class HealError(WorkerError):
    """A lost trainer rank could not be healed from a replica: no live rank holds its shards at the step."""


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


def _reward_model(policy: PreTrainedModel) -> ScalarModel:
    """A ScalarModel of `policy`'s body in the driver, to carry weights: this process's torch RNG is left as it
    was (the head's init draws from it before zeroing it), so the run samples as it would without this copy."""
    with torch.random.fork_rng(devices=[]):
        return ScalarModel.from_policy(policy)


@dataclass(frozen=True)
class HealHooks:
    """What a heal of the trainer (runtime.trainer_replicas > 1) tells the rest of the run, given when the roles
    are built: the checkpoint in flight lost a rank's shards (drop it); the heal's time (a metrics row's note)."""

    drop_save: Callable[[], None] = lambda: None  # the run's SaveInFlight.abandon
    note: Callable[[dict[str, Any]], None] = lambda row: None  # the metrics logger's note_sum


class ActorRole:
    """The policy trainer's ranks (a WorkerGroup of ActorWorkers); the frozen reference, when the run has one, is
    a role of its own (reference.ReferenceRole) that this class drives."""

    def __init__(
        self,
        group: WorkerGroup,
        model: PreTrainedModel,
        reference: ReferenceRole | None = None,
        replicas: int = 1,
        restart: Callable[[], None] | None = None,
        recovery: Recovery | None = None,
        hooks: HealHooks = HealHooks(),
    ) -> None:
        """model: the driver's policy: the one the local rank trains, or (ray) a copy that state() fills.
        replicas, restart, recovery (ray, runtime.trainer_replicas > 1): `restart` replaces every trainer rank in its
        bundle in a new world with the weight sync reopened (roles._RayRun.restart_trainer); a lost rank is healed
        from a live replica through it when the run's `recovery` allows, telling the run through `hooks`."""
        self.group = group
        self.model = model
        self.reference = reference
        self.replicas, self.restart, self.recovery = replicas, restart, recovery
        self.updates = 0  # optimizer steps of the phase, as the ranks count them (PolicyTrainer.updates)
        self._phase: tuple[Any, ...] | None = (
            None  # start_phase's arguments, for healed ranks' fresh trainers
        )
        self.hooks = hooks
        self._driver = threading.get_ident()  # the thread that drives the run: the one that heals

    def _run(self, method: str, *args: Any, failure: WorkerError | None = None) -> Any:
        """`method` on the trainer's ranks as its @dispatch declares (the group splits and gathers), through the
        recovery guard: every call that a lost rank can fail heals the same way."""
        train = rule_of(self.group.cls, method).train
        return self.guarded(lambda: self.group.run(method, *args), train=train, failure=failure)

    def start_phase(
        self,
        optim: OptimConfig,
        total_steps: int,
        resume: CheckpointParts | None,
        reference: bool = False,
        loss: PolicyLoss | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self._run("start_phase", optim, total_steps, resume, loss, micro_batch_size)
        self._phase, self.updates = (optim, total_steps, loss, micro_batch_size), 0
        if reference:  # the policy as the phase starts, frozen; a resumed phase reads its shards back
            restore = resume.reference if resume is not None else None
            weights = None if restore else self._run("weights")
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
        digests = self._run("replica_digest")
        per = len(digests) // self.replicas
        return all(d == digests[r % per] for r, d in enumerate(digests))

    def _can_heal(self, failure: WorkerError) -> bool:
        """Whether to heal now: a replica, an allowance, and the run's own thread. A loss met by a checkpoint that
        finishes in the background is raised there (that save is dropped): the driver's next call meets the same
        loss and heals, so that two threads never replace the ranks at once."""
        return (
            threading.get_ident() == self._driver
            and self.restart is not None
            and self.recovery is not None
            and self._phase is not None
            and self.recovery.may_heal(failure, self.group.role)
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
        cast(Recovery, self.recovery).healed()
        self.hooks.drop_save()  # a checkpoint in flight lost the rank's shards: it never becomes latest
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
        self.hooks.note({"heal_actor_s": seconds, "heals": 1})  # summed on the row of the step it healed
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

    # The trainer's calls: each worker method's @dispatch says how its batch splits and its results gather.

    def logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        return self._reference().logprobs(batch) if reference else self._run("logprobs", batch)

    def behaviour_logprobs(self, batch: TokenBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run("behaviour_logprobs", batch, temperature)

    def sft_step(self, batch: TokenBatch, micro_batch_size: int, lr_scale: float = 1.0) -> SFTStepStats:
        return self._run("sft_step", batch, micro_batch_size, lr_scale)

    def policy_step(self, batch: RolloutBatch, kl_coef: float) -> PolicyStepStats:
        return self._run("policy_step", batch, kl_coef)

    def sequence_logprobs(self, batch: TokenBatch, reference: bool = False) -> torch.Tensor:
        if reference:
            return (self._reference().logprobs(batch) * batch.response_mask).sum(dim=1)
        return self._run("sequence_logprobs", batch)

    def dpo_step(self, pairs: PairBatch, cfg: DPOConfig) -> DPOStepStats:
        return self._run("dpo_step", pairs, cfg)

    def start_reward(self, cfg: RewardModelConfig, total_steps: int, restore: str | None = None) -> None:
        weights = _reward_model(self.policy()).state_dict()  # one copy for all ranks
        self._run("start_reward", self.group.put(weights), cfg, total_steps, restore)
        # a replica's state holds the policy, not the reward model: a lost rank restarts from the checkpoint
        self._phase = None

    def reward_step(self, pairs: PairBatch) -> RewardStepStats:
        return self._run("reward_step", pairs)

    def reward_scores(self, batch: TokenBatch) -> torch.Tensor:
        return self._run("reward_scores", batch)

    def reward_model(self) -> ScalarModel:
        model = _reward_model(self.model)
        model.load_state_dict(self._run("reward_weights"))
        return model

    def policy(self) -> PreTrainedModel:
        self.model.load_state_dict(self._run("weights"))  # local: the model's own tensors, unchanged
        return self.model

    def state(self) -> tuple[PreTrainedModel, dict]:
        weights, trainer_state = self._run("state")
        self.model.load_state_dict(weights)
        return self.model, trainer_state

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._run("load_weights", self.group.put(dict(weights)))

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None:
        saves = self.group.call_async("save_state", path, hf_dir, blocking)
        if reference:  # the reference's ranks write its shards there meanwhile
            self._reference().save(reference, blocking)
        try:
            self.group.wait(saves)
        except WorkerError as e:  # healed: the healthy state is the one being saved, written again
            self._run("save_state", path, hf_dir, blocking, failure=e)

    def wait_saved(self, timeout_s: float) -> None:
        self.guarded(lambda: self.group.run("wait_saved", timeout_s, timeout_s=timeout_s + 30.0))
        if self.reference is not None:
            self.reference.wait_saved(timeout_s)

    def load_state(self, path: str) -> None:
        self._run("load_state", path)


def local_actor(model: PreTrainedModel, cfg: RunConfig | None = None) -> ActorRole:
    """The actor as the local backend runs it: one rank in this process, training `model` in place, with a
    reference rank that copies it when a phase asks for one."""
    cfg = cfg if cfg is not None else RunConfig()
    reference = ReferenceRole(LocalGroup(ReferenceWorker, role="ref", init_args=(cfg, model)), sharded=False)
    return ActorRole(LocalGroup(ActorWorker, role="actor", init_args=(cfg, model)), model, reference)
