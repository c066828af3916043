"""Start the roles of one run on cfg.runtime.backend: the one place that reads it.

Every role is one worker class (runtime.actor_worker.ActorWorker, engine.EngineWorker, critic.CriticWorker,
reference.ReferenceWorker; the scorer's env workers run envs.episodes) under one driver (ActorRole,
RolloutRole, CriticRole, ReferenceRole, ScorerRole), the same code on both backends:
- local: each group is one rank in this process (a LocalGroup), given the driver's objects: the
  actor trains `model` in place, the engine holds its own copy of the weights and samples from this process's
  torch RNG, the weight sync runs the planned transfer as in-process copies, the scorer's env workers are processes.
- ray: the pools are placed (runtime.placement), each group is a RayGroup of one Ray actor per bundle, the trainer ranks form
  their own torch.distributed world (FSDP2, TP), the critic and the reference worlds of their own placed like the
  actor, and the weight sync runs the planned transfer over a sync group of the trainer ranks and the engines.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loopline.checkpoint.faults import FAULTS
from loopline.config import RunConfig
from loopline.distributed.cluster import ClusterConfig
from loopline.distributed.dispatch import RankMesh
from loopline.distributed.placement import PlacementConfig
from loopline.distributed.workers import LocalGroup, RayGroup, WorkerGroup
from loopline.runtime.actor import ActorRole, HealHooks
from loopline.runtime.actor_worker import ActorWorker
from loopline.runtime.engine import EngineWorker, RolloutRole, make_engine
from loopline.runtime.engine_sync import CollectiveSync, InProcessSync
from loopline.runtime.protocols import Actor, Critic, Rollout, Scorer
from loopline.runtime.recovery import Recovery
from loopline.runtime.reference import ReferenceRole, ReferenceWorker
from loopline.runtime.scorer import ScorerRole
from loopline.training.lora import apply_lora
from loopline.training.precision import cast_in_forward

if TYPE_CHECKING:
    from loopline.distributed.placement import Pool


@dataclass
class Roles:
    """The roles of one run, and how to stop them (worker groups, placement groups, the Ray it started)."""

    actor: Actor
    rollout: Rollout
    scorer: Scorer
    shutdown: Callable[[], None]
    critic: Critic | None = None  # PPO's critic (grpo.advantage=gae)
    # ray: new actors for one role's ranks ("actor": spares too, and the weight sync rebuilt); the rest run on
    restart_group: Callable[[str], None] | None = None


# The roles whose ranks a ray run can replace alone (runtime.restart_scope=role); engines and env workers are
# replaced by their own pools without a restart.
RESTARTABLE = ("actor", "critic", "ref")


def build_roles(
    cfg: RunConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    hooks: HealHooks | None = None,
    recovery: Recovery | None = None,
) -> Roles:
    """The roles on cfg.runtime.backend; `model` is the policy in this process (trained by the local actor, a
    copy for checkpoints on ray). hooks: what a heal of the trainer tells the run (ray, trainer_replicas > 1);
    recovery: the run's allowances of restarts, heals and engine replacements (ray; a new one when None)."""
    if cfg.runtime.backend == "local":
        return _local_roles(cfg, model, tokenizer)
    return _ray_roles(cfg, model, hooks or HealHooks(), recovery or Recovery(cfg.runtime))


def _local_roles(cfg: RunConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Roles:
    """One rank of each role in this process, on the driver's objects."""
    from loopline.runtime.critic import CriticRole, CriticWorker

    # The engine is a module of its own (its own mode, hooks and cache), on the actor's parameters where
    # cfg.engine_shares_weights, else on a copy; either way the weight sync runs, as it does across processes.
    shared = {id(p): p for p in model.parameters()} if cfg.engine_shares_weights else {}
    engine = make_engine(cfg, copy.deepcopy(model, shared), tokenizer, seed=None)
    if cfg.model.lora.r:  # the actor trains adapters; the engine keeps a plain model, fed merged weights
        apply_lora(model, cfg.model.lora)
    # training.mixed_precision: the trainer's forwards on bf16 copies of its fp32 weights (FSDP2's policy on ray);
    # the reference and the critic, deep copies of this model, compute the same way
    cast_in_forward(model, cfg.training.mixed_precision)
    trainer = LocalGroup(ActorWorker, role="actor", init_args=(cfg, model))
    engines = LocalGroup(EngineWorker, role="rollout", init_args=(cfg, engine))
    reference = None
    if wants_reference(cfg):  # its rank holds nothing until a phase asks for a reference
        reference = ReferenceRole(
            LocalGroup(ReferenceWorker, role="ref", init_args=(cfg, model)), sharded=False
        )
    critic = None
    if cfg.grpo.advantage == "gae":
        critic = CriticRole(LocalGroup(CriticWorker, role="critic", init_args=(cfg, model)), sharded=False)
    rollout = RolloutRole(engines, InProcessSync(trainer, engines))
    # the env workers are processes; they start in the background
    rt = cfg.runtime
    scorer = ScorerRole(
        cfg.env,
        workers=rt.env_workers,
        task_timeout_s=rt.env_task_timeout_s,
        max_attempts=rt.env_task_attempts,
    )
    groups = [trainer, engines, *(r.group for r in (reference, critic) if r is not None)]

    def shutdown() -> None:
        scorer.close()
        for group in reversed(groups):  # each puts back the environment it found
            group.shutdown()

    return Roles(ActorRole(trainer, model, reference), rollout, scorer, shutdown, critic)


def wants_reference(cfg: RunConfig) -> bool:
    """A frozen reference role: the KL term of RL (grpo.kl_coef > 0), or DPO's reference asked for per batch."""
    return cfg.grpo.kl_coef > 0 or cfg.dpo.reference == "online"


def _local_cluster(cluster: ClusterConfig, placement: PlacementConfig) -> ClusterConfig:
    """A local Ray gets at least the CPUs the pools ask for: Ray's CPUs are scheduling slots, and on a
    laptop the roles share the cores (num_cpus=0 means all cores; a cluster joined by address is as it is)."""
    if cluster.address or cluster.num_cpus:
        return cluster
    wanted = math.ceil(sum(p.bundles * p.resources.get("CPU", 0.0) for p in placement.pools))
    return cluster.model_copy(update={"num_cpus": max(os.cpu_count() or 1, wanted)})


def _ray_roles(cfg: RunConfig, model: PreTrainedModel, hooks: HealHooks, recovery: Recovery) -> Roles:
    """Start or join Ray, place the pools, start the worker groups, the trainer's world and the sync group."""
    rt = cfg.runtime
    if rt.trainer_tp > 1:  # a model without a TP plan, or sizes that do not divide: say so before Ray starts
        from loopline.training.parallel import check_tp

        check_tp(model, rt.trainer_tp)
    if rt.trainer_pp > 1:  # a model of another layout, or layers that do not divide into the stages
        from loopline.training.pipeline import check_split

        check_split(model, rt.trainer_pp, rt.trainer_pp_virtual)
    run = _RayRun(cfg, recovery)
    try:
        run.place()
        run.start()
    except BaseException:
        run.shutdown()
        raise
    assert (
        run.trainer is not None and run.rollout is not None and run.scorer is not None
    )  # started, or raised
    heal = run.restart_trainer if rt.trainer_replicas > 1 else None
    actor = ActorRole(run.trainer, model, run.reference, rt.trainer_replicas, heal, recovery, hooks)
    return Roles(actor, run.rollout, run.scorer, run.shutdown, run.critic, run.restart_group)


class _RayRun:
    """The Ray side of one run's roles: the pools, the worker groups, the weight sync; how to start them (again,
    when a rank is lost while they start), restart one role's ranks, and stop them all."""

    def __init__(self, cfg: RunConfig, recovery: Recovery) -> None:
        from loopline.distributed.cluster import start_ray
        from loopline.distributed.nodes import NodeWatcher

        self.cfg, self.rt, self.recovery = cfg, cfg.runtime, recovery
        self.placement = self.rt.pools()
        self.started = start_ray(_local_cluster(self.rt.cluster, self.placement))
        # a node's death learned as Ray declares it; a lost node's ranks replaced once their bundles are placed again
        self.nodes = NodeWatcher(self.rt.capacity_wait_s, recovery.resume_hint)
        self.groups: list[WorkerGroup] = []
        self.pools: dict[str, Pool] = {}
        self.scorer: ScorerRole | None = None
        self.rollout: RolloutRole | None = None
        self.critic: Any = None  # CriticRole (PPO's critic), once started
        self.reference: ReferenceRole | None = None
        self.trainer: WorkerGroup | None = None
        self.sync: CollectiveSync | None = None
        self.workers: dict[str, tuple[type, int, tuple[Any, ...]]] = {}  # role -> (worker class, ranks, args)
        self.where: dict[str, Pool] = {}  # role -> the pool its ranks are placed in

    def place(self) -> None:
        """Place the pools, start the env workers (in the background) and say which worker groups go where."""
        from loopline.distributed.placement import place_pools
        from loopline.runtime.critic import CriticWorker, colocated_pool

        cfg, rt = self.cfg, self.rt
        self.pools = pools = place_pools(self.placement)
        self.scorer = ScorerRole(
            cfg.env, pools["env"], rt.env_workers, rt.env_task_timeout_s, rt.env_task_attempts
        )
        self.workers = {
            "actor": (ActorWorker, rt.trainer_ranks, (cfg,)),
            "rollout": (EngineWorker, rt.engines, (cfg,)),
        }
        # PPO's critic and the frozen reference (KL): as many ranks as the actor each, placed like it
        self.where = dict(pools)
        for role, cls, wanted in (
            ("critic", CriticWorker, cfg.grpo.advantage == "gae"),
            ("ref", ReferenceWorker, wants_reference(cfg)),
        ):
            if wanted:
                self.workers[role] = (cls, rt.trainer_ranks, (cfg,))
                self.where[role] = colocated_pool(role, pools["actor"], pools)

    def start(self) -> None:
        """Start the groups; a rank lost meanwhile (its process killed, its node gone) costs a start again, as the
        run's recovery allows (Recovery.start), as a lost rank mid-run costs a restart. The env workers replace
        their own (envs.pool)."""
        self.recovery.start(self._start_groups, self.stop_groups)

    def _start_groups(self) -> None:
        """The worker groups, their worlds and the weight sync; the groups are in `groups` as they start."""
        from loopline.runtime.critic import CriticRole

        rt = self.rt
        # env_vars: the test hooks' variables (checkpoint.faults) reach the ranks, which get the raylet's environment
        options: dict[str, Any] = {
            "timeout_s": rt.call_timeout_s,
            "env_vars": FAULTS.env(),
            "nodes": self.nodes,
        }
        # the trainer ranks' spares: warm processes (runtime.trainer_warm as resolved), or built ranks with standby
        warm = rt.warm_processes()
        for role, (
            _,
            n,
            _,
        ) in self.workers.items():  # a node lost as they start: its bundles placed again first
            self.nodes.wait_pool(role, self.where[role], n)
        # Start the groups at once: a rank spends most of its start-up importing torch and transformers.
        with ThreadPoolExecutor(len(self.workers)) as threads:
            starting = [
                threads.submit(
                    RayGroup,
                    cls,
                    n,
                    role=role,
                    pool=self.where[role],
                    init_args=args,
                    standby=role == "actor" and (rt.trainer_standby or warm),
                    warm=warm,
                    mesh=RankMesh(rt.trainer_tp, rt.trainer_pp) if role == "actor" else None,
                    **options,
                )
                for role, (cls, n, args) in self.workers.items()
            ]
        self.groups.extend(f.result() for f in starting if f.exception() is None)
        trainer, engines, *others = (f.result() for f in starting)  # raises the first failure
        # The trainer ranks form their own world (FSDP2, checkpoints); the weight sync gets a group of its own
        # over the trainer ranks and the engines (the rollout opens it), so the engines can change.
        address, layout = trainer.run("join", trainer.run("rendezvous"))
        self.trainer, self.sync = trainer, CollectiveSync(trainer, engines, address, layout)
        self.rollout = RolloutRole(engines, self.sync, self.pools["rollout"], self.recovery)
        more = dict(zip(list(self.workers)[2:], others))  # role -> group: critic, ref
        self.critic = (
            CriticRole(more["critic"]) if "critic" in more else None
        )  # its ranks join a world of their own
        self.reference = ReferenceRole(more["ref"]) if "ref" in more else None  # so do the reference's

    def stop_groups(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None
        for group in self.groups:
            group.shutdown()
        self.groups.clear()

    def shutdown(self) -> None:
        import ray

        from loopline.distributed.placement import remove_pools

        if self.scorer is not None:
            self.scorer.close()
        self.stop_groups()
        if self.pools:
            remove_pools(self.pools)
        if self.started:
            ray.shutdown()

    def restart_group(self, role: str) -> None:
        """A rank of `role` died (or its world broke): that role's ranks are replaced, the rest keep running; the
        caller loads the checkpoint. Prints where the time went."""
        if role == "actor":
            self.restart_trainer()
            return
        group = {"critic": self.critic, "ref": self.reference}[role]
        if group is None:
            raise ValueError(f"this run has no {role!r} group to restart")
        t0 = time.perf_counter()
        group.group.restart_ranks(list(range(group.group.world_size)))
        t1 = time.perf_counter()
        group.group.call("join", group.group.run("rendezvous"))  # a new world of their own
        print(
            f"{role} ranks restarted in {time.perf_counter() - t0:.2f}s (new actors {t1 - t0:.2f}s, world joined "
            f"{time.perf_counter() - t1:.2f}s)",
            flush=True,
        )

    def restart_trainer(self) -> None:
        """A trainer rank died (or its world broke): every rank's actor is replaced in its bundle (by its spare with
        runtime.trainer_standby), the new ranks form a new world, and the engines open the weight sync against its
        new store. The caller loads the checkpoint into it; engines, env workers, the critic and the reference keep
        running. Prints where the time went."""
        trainer, sync = cast(WorkerGroup, self.trainer), cast(CollectiveSync, self.sync)
        t0 = time.perf_counter()
        trainer.restart_ranks(list(range(trainer.world_size)))  # new processes import torch; spares have
        t1 = time.perf_counter()
        # the new world, the model sharded over it, rank 0 serving the sync's store
        sync.serve(*trainer.run("join", trainer.run("rendezvous")))
        t2 = time.perf_counter()
        sync.open()  # the engines reconnect
        t3 = time.perf_counter()
        # runtime.trainer_standby/_warm: new spares start once a step has trained on these ranks (ActorRole.guarded),
        # not now: on a small machine their imports would slow the first step down
        print(
            f"trainer ranks restarted in {t3 - t0:.2f}s (new actors {t1 - t0:.2f}s, world joined "
            f"{t2 - t1:.2f}s, weight sync reopened {t3 - t2:.2f}s)",
            flush=True,
        )
