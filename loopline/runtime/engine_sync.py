"""The weight sync between the actor's ranks and the rollout engines: one object, built with the roles.

- `InProcessSync`: the actor's one rank and the engines live in this process (the local backend): each push runs
  the same planned transfer (one unsharded trainer rank into the engines) as plain tensor copies, from the
  policy's tensors (LoRA adapters folded in) into each engine's model in place; no process group.
- `CollectiveSync` (ray): the trainer ranks form a torch.distributed world of their own (FSDP2, checkpoints); the
  sync runs over a separate gloo group (weight_sync.SyncGroup) of the trainer ranks (ranks 0..n-1) and the
  current engines (n..n+m-1), opened as a new generation whenever the engines change, so engines can die,
  join or leave while the trainer ranks run on. Each push runs the planned transfer of distributed.weight_sync:
  every trainer rank sends its own FSDP2 shards straight to the engines, a bucket at a time; no rank gathers
  the model.

The rollout driver (runtime.engine.RolloutRole) decides what to do about an engine that died in a push.
"""

from __future__ import annotations

from typing import Any

import torch

from loopline.distributed.workers import WorkerDiedError, WorkerError, WorkerGroup


def plan_params(model: torch.nn.Module, tp: int, dtype: str | None = None) -> tuple[list[Any], Any]:
    """What the weight-sync planner reads off a whole model (an engine's, or the trainer's before any pipeline
    split): its parameters (names, shapes, dtypes) and the dim the trainer's TP (of `tp` ranks) splits each on.
    dtype: the engines' (rollout.dtype, resolved), when it is not the model's: the plan moves that dtype, and a
    trainer rank casts its shards to it as it packs them."""
    from loopline.distributed.resharding import default_tp_dim
    from loopline.distributed.weight_sync import param_specs
    from loopline.models.load import DTYPES
    from loopline.training.parallel import tp_param_dims

    specs = param_specs(model, DTYPES[dtype] if dtype else None)
    return specs, tp_param_dims(model) if tp > 1 else default_tp_dim


def sync_plan(
    plan: Any, model: torch.nn.Module | tuple[list[Any], Any], layout: Any, targets: tuple[int, ...]
) -> Any:
    """The weight-sync plan into engines `targets`: `plan` if it is that plan already, else a new one.
    model: the whole model, or its `plan_params` (a pipelined trainer rank holds only its stages)."""
    from loopline.distributed.weight_sync import engines_plan

    targets = tuple(targets)
    if (
        plan is not None
        and plan.trainer == layout
        and tuple(plan.dst_ranks.reshape(-1)) == tuple(layout.size + i for i in targets)
    ):
        return plan
    specs, rule = model if isinstance(model, tuple) else plan_params(model, layout.tp)
    return engines_plan(specs, layout, targets, rule)


class InProcessSync:
    """The planned transfer run as in-process copies: the actor's one rank and the engines live in this process."""

    def __init__(self, trainer: WorkerGroup, engines: WorkerGroup) -> None:
        from loopline.distributed.resharding import TrainerLayout

        self.trainer, self.engines = trainer, engines
        self.layout = TrainerLayout(fsdp=1)  # the one unsharded trainer rank: its shards are whole tensors
        self.generation = 0  # nothing to reconnect: every tensor is in this process

    def open(self) -> None:
        pass

    def push(self, version: int, targets: tuple[int, ...]) -> list[int]:
        # trainer rank -> its live tensors (adapters merged): the plan's sources, no copy until the engine's
        shards = dict(enumerate(self.trainer.call("engine_weights")))
        copies = [
            self.engines.submit(i, "copy_weights", shards, self.layout, version, targets) for i in targets
        ]
        self.engines.wait(copies)
        return []


class CollectiveSync:
    """The planned transfer over a SyncGroup of the trainer ranks and the current engines (ray)."""

    def __init__(
        self, trainer: WorkerGroup, engines: WorkerGroup, address: tuple[str, int], layout: Any
    ) -> None:
        """trainer: the actor's ranks; engines: the rollout's; address: the sync store (served by trainer rank
        0, from its join); layout: the trainer's TrainerLayout."""
        self.trainer, self.engines = trainer, engines
        self.address, self.layout = address, layout
        self.generation = 0  # of the sync group
        self.store = 0  # of the store at `address`: one more each time the trainer ranks restart (serve())

    def serve(self, address: tuple[str, int], layout: Any) -> None:
        """New trainer ranks serve the sync's store at `address` (the next open connects the engines to it)."""
        self.address, self.layout = address, layout
        self.store += 1

    def open(self) -> None:
        """Every trainer rank and engine opens the next generation of the sync group (the old one is dropped)."""
        self.generation += 1
        engines = self.engines.world_size
        opens = self.trainer.call_async("open_sync", self.address, self.generation, engines)
        engine_opens = self.engines.call_async(
            "open_sync", self.address, self.generation, self.layout, engines, self.store
        )
        self.engines.wait(engine_opens)
        self.trainer.wait(opens)

    def push(self, version: int, targets: tuple[int, ...]) -> list[int]:
        sends = self.trainer.call_async("send_weights", targets)
        receives = [self.engines.submit(i, "receive_weights", version, targets) for i in targets]
        received = self.engines.settle(
            receives
        )  # the first: a failed rank closes its group, and the rest fail
        sent = self.trainer.settle(sends)
        died = [f.rank for f, o in zip(receives, received) if isinstance(o, WorkerDiedError)]
        trainer_died = [o for o in sent if isinstance(o, WorkerDiedError)]
        if trainer_died or not died:  # a failure that is not an engine's death is the run's
            for outcome in [*trainer_died, *sent, *received]:
                if isinstance(outcome, WorkerError):
                    raise outcome
            return []
        return died
