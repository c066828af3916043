"""The runtime section: which backend runs the roles, how many ranks each gets, and on which Ray cluster and
placement (runtime.cluster's and runtime.placement's sections). Read by runtime.roles; knows no model, so it
sits low in runtime's layers. Pydantic only, so loading a config stays light.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loopline.distributed.cluster import ClusterConfig
from loopline.distributed.placement import PlacementConfig, PoolConfig
from loopline.section import Section


class RuntimeConfig(Section):
    """Where the roles run: all in this process (local), or as worker groups on a Ray cluster (ray)."""

    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: one process, no cluster; ray: actor, rollout and env worker groups on Ray.",
    )
    trainer_ranks: int = Field(
        1,
        gt=0,
        description="FSDP2 ranks of the actor (ray); each gets an equal slice, micro_batch_size is per rank.",
    )
    trainer_tp: int = Field(
        1,
        gt=0,
        description="Tensor-parallel size of the actor (ray): trainer_ranks form a (trainer_ranks/trainer_tp, "
        "trainer_tp) mesh; each group of trainer_tp ranks splits the decoder layers (the model's HF TP plan) "
        "and shares one data slice.",
    )
    trainer_pp: int = Field(
        1,
        gt=0,
        description="Pipeline-parallel size of the actor (ray): trainer_ranks form a (trainer_pp, "
        "trainer_ranks/(trainer_pp*trainer_tp), trainer_tp) mesh; each of trainer_pp stages holds a contiguous "
        "run of decoder layers (the first the embeddings, the last the norm and head).",
    )
    trainer_pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = Field(
        "1f1b",
        description="Pipeline schedule (trainer_pp > 1): gpipe (all forwards, then all backwards), 1f1b (one "
        "forward, one backward: fewer activations held), interleaved (1f1b over trainer_pp_virtual stages per "
        "rank: a smaller bubble).",
    )
    trainer_pp_virtual: int = Field(
        1,
        gt=0,
        description="Stages per pipeline rank: 1 with gpipe and 1f1b, at least 2 with interleaved; the model's "
        "layers must divide by trainer_pp * trainer_pp_virtual.",
    )
    trainer_replicas: int = Field(
        1,
        gt=0,
        description="Copies of the sharded actor (ray, HSDP): trainer_ranks form (trainer_replicas, "
        "trainer_ranks/(trainer_replicas*trainer_tp), trainer_tp); each replica shards the model over its ranks and "
        "gradients are summed across replicas. With 2 or more and runtime.max_restarts >= 1, a lost trainer rank "
        "heals from a live replica (its shards and optimizer state copied, no checkpoint loaded, no step trained "
        "again) instead of rolling back.",
    )
    trainer_ep: int = Field(
        1,
        gt=0,
        description="Expert parallelism of an MoE actor (ray): each MoE layer's experts are split over this many "
        "trainer ranks (1 or trainer_ranks for now), and every token goes to the ranks of its top-k experts and "
        "back with all_to_all instead of FSDP2 gathering every expert on every rank. The rest of the model is "
        "sharded by FSDP2 as before; checkpoints resume at any trainer_ep.",
    )
    engines: int = Field(
        1, gt=0, description="Rollout engines (ray), a whole model each; prompts split across them."
    )
    engine_max_rows: int = Field(
        0,
        ge=0,
        description="Sequences an engine computes at once (continuous batching: a prompt's samples enter as "
        "finished sequences free their rows); 0 = all of a call's sequences at once. Bounds the KV cache.",
    )
    env_workers: int = Field(
        1,
        gt=0,
        description="Env workers (processes on local, Ray actors on ray); a step's completions are split "
        "across them (env.name scores them).",
    )
    env_task_timeout_s: float = Field(
        60.0,
        gt=0,
        description="An env worker still on its chunk of a step this long, beyond what the env's own limits allow "
        "its episodes (env.sandbox.timeout_s for code, several at once; env.agent_timeout_s for agents), is taken "
        "for hung: replaced, and the chunk sent to another.",
    )
    env_task_attempts: int = Field(
        3, ge=1, description="Tries of a chunk on env workers that die or hang before the step fails."
    )
    call_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest wait for a call on a worker group, and for the trainer's collectives.",
    )
    capacity_wait_s: float = Field(
        300.0,
        ge=0,
        description="A node lost (ray: its raylet and every rank on it gone): the longest wait for its ranks' "
        "bundles to be placed again, on the nodes that remain or on one that joins (an autoscaler's or KubeRay's "
        "replacement), before the run exits 75 (EX_TEMPFAIL) in one line; what it waits for is printed every 30 s.",
    )
    stage_timeout_s: float = Field(
        0.0,
        ge=0,
        description="Watchdog: a loop stage (rollout, score, train, sync, eval, checkpoint) running longer "
        "than this fails the run with an error naming role, rank and stage; 0 = off.",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="When a call on a worker group fails (ray: a rank died, or a collective broke with it), "
        "restart the roles from the last checkpoint, at most this many times.",
    )
    restart_scope: Literal["role", "all"] = Field(
        "role",
        description="What such a restart replaces. role: the failed role's group alone where it can be (ray: a "
        "trainer, reference or critic rank's death restarts that role's ranks; the other roles, engines and env "
        "workers keep running), else every role; all: every role, always (stop the workers, start them again, "
        "load the checkpoint).",
    )
    trainer_standby: bool = Field(
        False,
        description="A spare for every trainer rank (ray, pools without GPUs): a second actor in the rank's bundle, "
        "built but idle, holding none of its resources; a per-role restart promotes the spares instead of "
        "starting processes (the torch import is paid already), then starts new ones. Costs a process and a "
        "model copy per rank.",
    )
    trainer_warm: bool | None = Field(
        None,
        description="A warm process for every trainer rank (ray, pools without GPUs): an actor in the rank's bundle "
        "that has imported torch and transformers but built nothing, holding none of its resources; a per-role "
        "restart or a heal builds the rank there instead of starting a process (the imports, most of a new rank's "
        "start-up, are paid), then starts new ones. Costs an idle process per rank, no model copy. "
        "Not with trainer_standby (whose spares are built ranks). null (default): on where a rank can be replaced "
        "alone (backend=ray, max_restarts > 0, and restart_scope=role or trainer_replicas > 1), the actor's "
        "pool has no GPUs and trainer_standby is off; false saves the idle processes.",
    )
    max_engine_replacements: int = Field(
        3,
        ge=0,
        description="Rollout engines whose actor dies (ray) are replaced in their bundle, synced to the current "
        "weights and their prompts issued again, at most this many times in a run; then the death is an error "
        "(and max_restarts applies).",
    )
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="Which Ray: a local one or an address."
    )
    placement: PlacementConfig | None = Field(
        None,
        description="Pools and role -> pool map (roles actor, rollout, env); None = one pool per role "
        "with a {CPU: 1} bundle per rank.",
    )

    @model_validator(mode="after")
    def _tp_divides(self) -> RuntimeConfig:
        if self.trainer_ranks % self.trainer_tp:
            raise ValueError(
                f"trainer_ranks={self.trainer_ranks} must be divisible by trainer_tp={self.trainer_tp}"
            )
        if self.trainer_ranks % (self.trainer_pp * self.trainer_tp):
            raise ValueError(
                f"trainer_ranks={self.trainer_ranks} must be divisible by trainer_pp * trainer_tp = "
                f"{self.trainer_pp} * {self.trainer_tp}"
            )
        if self.trainer_replicas > 1:
            r, tp = self.trainer_replicas, self.trainer_tp
            if self.backend != "ray":
                raise ValueError(f"trainer_replicas={r} needs backend=ray (the local backend runs one rank)")
            if self.trainer_pp > 1:
                raise ValueError(
                    f"trainer_replicas={r} with trainer_pp={self.trainer_pp}: replicas of a pipelined trainer are "
                    "not built; use trainer_replicas=1 or trainer_pp=1"
                )
            if self.trainer_ranks % (r * tp):
                raise ValueError(
                    f"trainer_ranks={self.trainer_ranks} must be divisible by trainer_replicas * trainer_tp = "
                    f"{r} * {tp}"
                )
        return self

    @model_validator(mode="after")
    def _ep_fits(self) -> RuntimeConfig:
        ep = self.trainer_ep
        if ep == 1:
            return self
        if self.backend != "ray":
            raise ValueError(f"trainer_ep={ep} needs backend=ray (the local backend runs one rank)")
        if ep != self.trainer_ranks:
            raise ValueError(
                f"trainer_ep={ep} must equal trainer_ranks={self.trainer_ranks}: the experts split over every "
                "trainer rank (a smaller expert group inside the data-parallel ranks is not built)"
            )
        for key, value in (
            ("trainer_tp", self.trainer_tp),
            ("trainer_pp", self.trainer_pp),
            ("trainer_replicas", self.trainer_replicas),
        ):
            if value > 1:
                raise ValueError(f"trainer_ep={ep} with {key}={value} is not built: set one of them to 1")
        if self.trainer_standby:
            raise ValueError(f"trainer_ep={ep} with trainer_standby=true is not built (use trainer_warm)")
        return self

    @model_validator(mode="after")
    def _pp_schedule_fits(self) -> RuntimeConfig:
        v, schedule = self.trainer_pp_virtual, self.trainer_pp_schedule
        if schedule == "interleaved" and (self.trainer_pp < 2 or v < 2):
            raise ValueError(
                f"trainer_pp_schedule=interleaved needs trainer_pp >= 2 and trainer_pp_virtual >= 2 (stages per "
                f"rank), got trainer_pp={self.trainer_pp}, trainer_pp_virtual={v}; or use gpipe or 1f1b"
            )
        if schedule != "interleaved" and v != 1:
            raise ValueError(
                f"trainer_pp_virtual={v} needs trainer_pp_schedule=interleaved ({schedule} holds one stage per rank)"
            )
        return self

    @model_validator(mode="after")
    def _standby_fits(self) -> RuntimeConfig:
        if self.trainer_standby and self.trainer_warm:
            raise ValueError(
                "trainer_standby=true and trainer_warm=true: a rank has one spare, built (standby) or a warm "
                "process (warm); give one of them"
            )
        field = "trainer_standby" if self.trainer_standby else "trainer_warm" if self.trainer_warm else None
        if field is None:
            return self
        if self.backend != "ray":
            raise ValueError(f"{field}=true needs backend=ray (spares are Ray actors)")
        if self._actor_has_gpus():
            raise ValueError(
                f"{field}=true: the actor's pool '{self.pools().roles.get('actor')}' has GPUs, which a spare "
                f"(holding none of its bundle's resources) cannot see; use {field}=false there"
            )
        return self

    @model_validator(mode="after")
    def _roles_fit(self) -> RuntimeConfig:
        if (
            self.backend == "local"
        ):  # one rank per role in this process; the env workers are processes, any number
            many = [f"{k}={v}" for k, v in self._ranks().items() if v > 1 and k != "env"]
            if many:
                raise ValueError(
                    f"backend 'local' runs one rank per role; {', '.join(many)} needs backend=ray"
                )
            return self
        if self.placement is None:
            return self
        pools = {p.name: p for p in self.placement.pools}
        for role, ranks in self._ranks().items():
            field = {"actor": "trainer_ranks", "rollout": "engines", "env": "env_workers"}[role]
            if role not in self.placement.roles:
                raise ValueError(
                    f"placement.roles must place role '{role}' (its {ranks} rank(s) need a pool)"
                )
            pool = pools[self.placement.roles[role]]
            if pool.bundles < ranks:
                raise ValueError(
                    f"{field}={ranks} but pool '{pool.name}' of role '{role}' has {pool.bundles} bundles"
                )
        return self

    def warm_processes(self) -> bool:
        """Whether the trainer ranks get warm processes: trainer_warm as given, or (null) where a rank can be
        replaced alone, on a pool a spare can use, without built spares."""
        if self.trainer_warm is not None:
            return self.trainer_warm
        if self.backend != "ray" or self.trainer_standby or self._actor_has_gpus():
            return False
        return self.max_restarts > 0 and (self.restart_scope == "role" or self.trainer_replicas > 1)

    def _actor_has_gpus(self) -> bool:
        pools = self.pools()
        pool = next((p for p in pools.pools if p.name == pools.roles.get("actor")), None)
        return pool is not None and pool.resources.get("GPU", 0.0) > 0

    def _ranks(self) -> dict[str, int]:
        return {"actor": self.trainer_ranks, "rollout": self.engines, "env": self.env_workers}

    def pools(self) -> PlacementConfig:
        """The placement a ray run uses: runtime.placement, or one pool per role with a {CPU: 1} bundle per rank."""
        if self.placement is not None:
            return self.placement
        sizes = self._ranks()
        return PlacementConfig(
            pools=[PoolConfig(name=role, bundles=n, resources={"CPU": 1.0}) for role, n in sizes.items()],
            roles={role: role for role in sizes},
        )
