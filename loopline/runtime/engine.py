"""The rollout role: generation engines, as a WorkerGroup of `EngineWorker`s driven by `RolloutRole`.

Each engine is a TorchEngine, or a VllmEngine with rollout.engine=vllm, on a whole model; the prompts are split
across the engines, and the weight sync (runtime.engine_sync, built with the roles) fills them from the actor.
Locally the group is one engine in this process with its own copy of the weights, sampling from this process's
torch RNG. On ray each engine samples from its own generator (seeded per engine rank); the loop checkpoints the
generators' states (`rng_states`) and restores them, so a resumed ray run repeats the uninterrupted one bit for
bit, as the local backend does.

Elastic engines (ray): an engine whose actor dies (in generate or in a sync) is replaced in its bundle, synced,
and its prompts issued again; `resize` adds or removes engines between steps.

Simplified: engines are TP=1 (the planner and transport handle TP>1, the engine does not yet).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loopline.checkpoint.faults import FAULTS
from loopline.config import RunConfig
from loopline.distributed.workers import WorkerDiedError, WorkerError, WorkerGroup
from loopline.models.load import cast_parameters
from loopline.models.moe import recording_model
from loopline.rollout.engine import Completion, SamplingParams, TorchEngine
from loopline.runtime.config import RuntimeConfig
from loopline.runtime.engine_sync import sync_plan
from loopline.runtime.protocols import WeightSync
from loopline.runtime.ranks import node_address, rank_and_world, seeded_model
from loopline.runtime.recovery import Recovery

if TYPE_CHECKING:
    from loopline.distributed.placement import Pool
    from loopline.rollout.vllm_engine import VllmEngine


def make_engine(
    cfg: RunConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, seed: int | None
) -> TorchEngine | VllmEngine:
    """The engine cfg.rollout.engine names, on `model` (its own copy: the weight sync fills it); seed: its
    sampling generator's (None: the process's torch RNG). Its weights in rollout.dtype (the weight sync casts)."""
    cast_parameters(model, cfg.engine_dtype)
    if cfg.rollout.engine == "vllm":
        from loopline.rollout.vllm_engine import VllmEngine

        return VllmEngine(model, tokenizer, cfg.rollout.vllm, seed, cfg.runtime.engine_max_rows)
    return TorchEngine(
        model, tokenizer, seed=seed, max_rows=cfg.runtime.engine_max_rows,
        keep_stale_kv=cfg.grpo.partial_rollouts == "keep_stale_kv",
        record_routes=recording_model(model) is not None,  # an MoE's routes: replay, route_mismatch
        pack_weights=cfg.engine_packs_weights,
    )  # fmt: skip


class EngineWorker:
    """One rollout engine (TorchEngine or VllmEngine) on a whole model, filled by the weight sync."""

    # with grpo.partial_rollouts a weight sync lands while a generate call runs (on Ray: two calls at once)
    max_concurrency = 2

    def __init__(self, cfg: RunConfig, engine: TorchEngine | VllmEngine | None = None) -> None:
        """engine: an engine in this process (the local one-rank group); None: this rank loads the run's seeded
        initial model and samples from its own generator, seeded per engine rank (checkpointed: rng_state)."""
        self.cfg = cfg
        self.rank = rank_and_world()[0]
        # test hook: an engine lost while the roles start
        FAULTS.pause_point(f"init:rollout:{self.rank}", once=True)
        if engine is None:
            model, tokenizer = seeded_model(cfg, rng_offset=1 + self.rank)
            engine = make_engine(cfg, model, tokenizer, seed=cfg.seed + 1 + self.rank)
        self.engine = engine
        # grpo.partial_rollouts: the sync writes into a copy that the engine takes at its next decode step
        self.partial = cfg.grpo.partial_rollouts != "none"
        self._staging: dict[str, torch.Tensor] | None = None
        self.sync: Any = None  # the weight-sync SyncGroup (trainer ranks + engines), once opened
        self.store = 0  # which store `sync` is connected to (CollectiveSync.store)
        self.layout: Any = None  # the trainer's TrainerLayout, from the driver
        self.plan: Any = None  # the weight-sync TransferPlan of the last sync

    def open_sync(
        self, address: tuple[str, int], generation: int, trainer: Any, engines: int, store: int = 0
    ) -> None:
        """Open generation `generation` of the weight-sync group as its rank trainer.size + RANK (the trainer's
        ranks come first), `engines` engines in all; `trainer` is the TrainerLayout the trainer ranks plan with;
        `store` numbers the store at `address` (restarted trainer ranks serve a new one, maybe on the same port)."""
        from loopline.distributed.weight_sync import SyncGroup

        if self.sync is None or self.store != store:
            self.sync = SyncGroup.connect(address, node_address(), self.cfg.runtime.call_timeout_s)
            self.store = store
        self.layout = trainer
        self.sync.open(generation, trainer.size + self.rank, trainer.size + engines)

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int) -> list[Completion]:
        return self.engine.generate(prompts, params, n) if prompts else []

    def receive_weights(self, version: int, targets: tuple[int, ...]) -> None:
        """This engine's part of the planned weight sync into engines `targets`: its tensors are written in place."""
        self.plan = sync_plan(self.plan, self.engine.model, self.layout, targets)
        with self._weights_for(version) as tensors:
            self.sync.sync(self.plan, None, tensors)

    def copy_weights(
        self,
        shards: Mapping[int, Mapping[str, torch.Tensor]],
        layout: Any,
        version: int,
        targets: tuple[int, ...],
    ) -> None:
        """This engine's part of the planned sync run in this process (the local sync): the plan's transfers copy
        the trainer ranks' `shards` (rank -> name -> tensor, laid out as `layout`) into its tensors in place."""
        from loopline.distributed.weight_sync import copy_in_process

        self.plan = sync_plan(self.plan, self.engine.model, layout, targets)
        with self._weights_for(version) as tensors:
            copy_in_process(self.plan, shards, {layout.size + self.rank: tensors})

    @contextmanager
    def _weights_for(self, version: int) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors a sync writes `version` into: the engine's own, or with partial rollouts a staging copy
        handed to the engine once whole (it loads it now if idle, else at its next decode step)."""
        from loopline.distributed.weight_sync import engine_tensors

        if not self.partial:
            yield engine_tensors(self.engine.model)
            self.engine.commit_weights(version)
            return
        engine = self.engine
        assert isinstance(engine, TorchEngine)  # RunConfig refuses partial rollouts on other engines
        engine.wait_taken()  # the staging copy is free again
        if self._staging is None:
            self._staging = {k: v.detach().clone() for k, v in engine_tensors(self.engine.model).items()}
        yield self._staging
        engine.offer_weights(self._staging, version)

    def weights(self) -> dict[str, torch.Tensor]:
        """This engine's whole weights (for checks: the sync delivered the trainer's bytes)."""
        return {k: v.detach().cpu() for k, v in self.engine.model.state_dict().items()}

    def rng_state(self) -> torch.Tensor | None:
        """This engine's sampling generator state."""
        return self.engine.rng_state()

    def set_rng_state(self, states: list[torch.Tensor | None], engines: int, reseed: int) -> bool:
        """This engine's generator from states[rank], or seeded from reseed + rank when they do not fit."""
        return restore_engine_rng(self.engine, states, self.rank, engines, reseed)


def restore_engine_rng(
    engine: TorchEngine | VllmEngine, states: list[torch.Tensor | None], rank: int, engines: int, reseed: int
) -> bool:
    """Engine `rank` of `engines`: its generator from states[rank] when the saved run had as many engines and
    both sample alike (own generator, or the process's RNG); otherwise seeded from reseed + rank. True if exact."""
    mine = engine.rng_state()
    if len(states) == engines and (states[rank] is None) == (mine is None):
        if mine is not None:
            engine.set_rng_state(states[rank])  # type: ignore[arg-type]  # not None: checked above
        return True
    if mine is not None:
        engine.reseed(reseed + rank)
    return False


def _chunks(items: list[Any], parts: int) -> list[tuple[int, list[Any]]]:
    """(offset, chunk) for `parts` contiguous chunks as even as can be (some may be empty)."""
    size = math.ceil(len(items) / parts) if items else 0
    return [(i * size, items[i * size : (i + 1) * size]) for i in range(parts)]


class RolloutRole:
    """Rollout engines as a WorkerGroup of EngineWorkers; each generates for its share of the prompts.

    The weight sync (`sync`) runs apart from the trainer's own world, so the engines can change while the
    trainer ranks keep running (ray, with a `pool`):
    - an engine whose actor dies (in generate or in a sync) is replaced by a new actor in its bundle, the
      sync is reopened, the current weights are synced into the new engine (same version) and its prompts
      issued again; at most `max_replacements` times, then the death is raised;
    - `resize` adds engines (free bundles of the rollout pool first, then a placement group of one bundle
      each, if the cluster has room) or removes the last ones, between steps.
    """

    def __init__(
        self, group: WorkerGroup, sync: WeightSync, pool: Pool | None = None, recovery: Recovery | None = None
    ) -> None:
        """group: the engines; sync: the weight sync from the actor's ranks into them; pool: the rollout pool
        (ray; None: the engines cannot change); recovery: the run's, which says how many engine deaths it survives
        (None: runtime.max_engine_replacements' default)."""
        self.group, self.sync, self.pool = group, sync, pool
        self.recovery = recovery if recovery is not None else Recovery(RuntimeConfig())
        # grpo.partial_rollouts: the trainer syncs while the rollout thread generates; either may replace an engine
        self._lock = threading.RLock()
        self._incarnation = [0] * group.world_size  # actors each rank has had: a death is replaced once
        self.version: int | None = None  # policy version of the last sync (None: the initial weights)
        self._own: dict[
            int, Pool
        ] = {}  # id(pool) -> a placement group of one bundle holding one added engine
        self.sync.open()

    # -----------------------------------------------------------------------------------------------------
    # The Rollout interface
    # -----------------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        chunks = _chunks(prompts, self.group.world_size)
        done: dict[int, list[Completion]] = {}
        todo = list(range(len(chunks)))
        while todo:  # a dead engine's prompts go again to its replacement; the others' results are kept
            seen = list(self._incarnation)
            futures = [self.group.submit(r, "generate", chunks[r][1], params, n) for r in todo]
            died = []
            for r, outcome in zip(todo, self.group.settle(futures)):
                if isinstance(outcome, WorkerDiedError):
                    died.append(r)
                elif isinstance(outcome, WorkerError):
                    raise outcome
                else:
                    done[r] = outcome
            self._recover(died, seen, "generate")
            todo = died
        out = []
        for r, (offset, _) in enumerate(chunks):
            for c in done[r]:
                c.prompt_index += offset  # an engine numbers its own prompts from 0
                out.append(c)
        return out

    def update_weights(self, version: int) -> None:
        """Sync the actor's weights into every engine."""
        self._sync(version, tuple(range(self.group.world_size)))

    def rng_states(self) -> list[torch.Tensor | None]:
        while True:  # a dead engine is replaced (a new one samples from a fresh stream) and asked again
            seen = list(self._incarnation)
            states = self.group.settle([self.group.submit(r, "rng_state") for r in range(self.engines)])
            died = [r for r, s in enumerate(states) if isinstance(s, WorkerDiedError)]
            for s in states:
                if isinstance(s, WorkerError) and not isinstance(s, WorkerDiedError):
                    raise s
            if not died:
                return states
            self._recover(died, seen, "rng_state")

    def set_rng_states(self, states: list[torch.Tensor | None], reseed: int) -> bool:
        return all(self.group.call("set_rng_state", states, self.group.world_size, reseed))

    # -----------------------------------------------------------------------------------------------------
    # Elastic engines
    # -----------------------------------------------------------------------------------------------------

    @property
    def replacements(self) -> int:
        """Engines replaced so far in the run."""
        return self.recovery.engines.used

    @property
    def engines(self) -> int:
        """Engines running now."""
        return self.group.world_size

    def resize(self, engines: int) -> None:
        """Run `engines` engines from now on (between steps): start new ones, synced to the current weights, or
        stop the last ones. Raises PlacementError, naming the shortfall, when the cluster has no room for more."""
        if self.pool is None:
            raise ValueError(
                "these engines run in this process and cannot change while the run runs (use runtime.backend=ray)"
            )
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
        self._incarnation = (self._incarnation + [0] * engines)[:engines]
        self.sync.open()
        self._sync(self.version, tuple(range(before, engines)))

    def close(self) -> None:
        """Release the placement groups of engines added beyond the rollout pool (the caller stops the group)."""
        from loopline.distributed.placement import remove_pools

        if self._own:
            remove_pools({str(k): p for k, p in self._own.items()})
            self._own.clear()

    # -----------------------------------------------------------------------------------------------------
    # Plumbing: syncing, replacing dead engines, finding room for new ones
    # -----------------------------------------------------------------------------------------------------

    def _sync(self, version: int | None, targets: tuple[int, ...]) -> None:
        """Sync the trainer's weights into engines `targets` as `version`; an engine that dies meanwhile is
        replaced and then every engine synced again (the others may hold part of the new weights)."""
        if version is None or not targets:
            return  # before the first sync every engine, a new one too, holds the initial weights
        with self._lock:
            while died := self.sync.push(version, targets):
                self._replace(died, "receive_weights")
                targets = tuple(range(self.group.world_size))
            self.version = version

    def _recover(self, died: list[int], seen: list[int], method: str) -> None:
        """Engines `died` (found dead in `method`, issued when ranks had `seen` incarnations) replaced and synced to
        the weights the others hold, unless another thread (a weight sync) found the death first and did it."""
        if not died:
            return
        with self._lock:
            fresh = [r for r in died if self._incarnation[r] == seen[r]]
            self._replace(fresh, method)
            self._sync(self.version, tuple(fresh))

    def _replace(self, ranks: list[int], method: str) -> None:
        """New actors for the dead engines `ranks`, in their bundles, and a reopened sync (no sync here)."""
        if not ranks:
            return
        start = time.perf_counter()
        for rank in ranks:
            self.recovery.replace_engine(rank, method)  # raises when the run's allowance is used up
            self._incarnation[rank] += 1
            self.group.restart_rank(rank)
        self.sync.open()
        print(
            f"rollout engine(s) {ranks} died in {method}(): replaced in {time.perf_counter() - start:.1f}s "
            f"(sync group generation {self.sync.generation}; {self.replacements} of "
            f"{self.recovery.engines.limit} replacements used)",
            flush=True,
        )

    def _free_places(self, count: int) -> list[tuple[Pool, int]]:
        """(pool, bundle) for `count` more engines: free bundles of the rollout pool, then new one-bundle pools."""
        from loopline.distributed.placement import PlacementConfig, PlacementError, PoolConfig, place_pools

        pool = self.pool
        assert pool is not None  # resize checked
        used = {b for p, b in self.group.places() if p is pool}
        places = [(pool, b) for b in range(pool.num_bundles) if b not in used][:count]
        share = {k: v for k, v in pool.rank_resources().items() if v > 0}  # what one engine takes
        try:
            while len(places) < count:
                name = f"rollout-added-{self.sync.generation}-{len(places)}"
                conf = PlacementConfig(
                    pools=[PoolConfig(name=name, bundles=1, resources=share)], roles={"rollout": name}
                )
                added = place_pools(conf)["rollout"]
                self._own[id(added)] = added
                places.append((added, 0))
        except PlacementError as e:
            room = len(places)
            self._release([p for p, _ in places])
            raise PlacementError(
                f"cannot run {self.group.world_size + count} rollout engines ({count} more): the rollout pool "
                f"'{pool.name}' has {pool.num_bundles} bundle(s), and the cluster has room for only "
                f"{room} more engine(s) of {share}; {e}"
            ) from e
        return places

    def _release(self, pools: list[Pool]) -> None:
        """Remove the one-bundle placement groups among `pools` (bundles of the rollout pool stay reserved)."""
        from loopline.distributed.placement import remove_pools

        own = {str(id(p)): p for p in pools if self._own.pop(id(p), None) is not None}
        if own:
            remove_pools(own)
