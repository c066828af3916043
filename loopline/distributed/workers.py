"""Worker groups: N ranks of one plain Python class, driven by a single controller.

The controller calls a method by name on every rank and gets one result per rank. `WorkerGroup` is the interface;
each backend is one implementation of it (runtime.roles picks which, once): `LocalGroup`, one rank in this process
called directly (the embedded default, no Ray); `RayGroup`, one Ray actor per bundle of the role's pool
(placement.place_pools), pinned to its bundle. Every rank finds RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in its environment (torch.distributed's env:// rendezvous). Failures name the role, the
rank and the method: a method that raised (WorkerError), a call not finished in time (WorkerTimeoutError), a rank
whose process or node is gone (WorkerDiedError).

A running RayGroup can change: `restart_ranks` replaces ranks' actors in their bundles (once a lost node's bundles
sit on live nodes again: distributed.nodes), `add_ranks` starts more in bundles the caller found, `remove_ranks`
stops the last ones; `settle` collects every outcome of a call, so a caller can recover from some failures. With
`standby`, every rank has a spare in its bundle: built (or, with `warm`, a process with its imports paid whose
constructor runs when promoted), never called, taking none of the bundle's resources; a restart promotes it
instead of starting a process (`start_spares` then starts new ones). Simplified on purpose: `max_restarts` is
passed to Ray as is; local calls run in the caller's thread, so the local backend cannot time a call out; WORLD_SIZE
in a rank's environment is the group's size when it started.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self, cast

from loopline.distributed.dispatch import RankMesh, gather, rule_of, split_args
from loopline.distributed.ray_actors import (
    ActorGone,
    ActorRaised,
    finished,
    free_port,
    get,
    in_bundle,
    kill,
    master_address,
    rank_env,
    start_actor,
    warm_class,
)

if TYPE_CHECKING:
    from loopline.distributed.nodes import NodeWatcher
    from loopline.distributed.placement import Pool


class WorkerError(RuntimeError):
    """A call on one rank failed; `role`, `rank` and `method` say where (the worker's exception is the cause)."""

    def __init__(self, role: str, rank: int, method: str, detail: str) -> None:
        super().__init__(f"role '{role}' rank {rank} {method}(): {detail}")
        self.role, self.rank, self.method = role, rank, method


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A call did not finish within its timeout; the rank may be stuck and keeps running until shutdown."""


class WorkerDiedError(WorkerError):
    """The rank's process died or cannot be reached (its Ray actor is dead or restarting)."""


@dataclass(frozen=True)
class RankFuture:
    """A call in flight on one rank; hand a list of these to WorkerGroup.wait."""

    rank: int
    method: str
    ref: Any  # ray.ObjectRef on the ray backend; an already finished concurrent.futures.Future on local


def _check_role(role: str, pool: Pool) -> None:
    if role not in pool.roles:
        raise ValueError(
            f"role '{role}' is not placed on pool '{pool.name}' (roles there: {list(pool.roles)})"
        )


class WorkerGroup(ABC):
    """N ranks of one worker class for one role; call a method on all ranks and get one result per rank.

    The interface both backends implement (LocalGroup, RayGroup): the calls, their futures and their failures are
    the same; only a Ray group's ranks can change while it runs (the local one raises ValueError)."""

    def __init__(
        self, cls: type, num_ranks: int, role: str, timeout_s: float | None, mesh: RankMesh | None
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"role '{role}': num_ranks must be >= 1, got {num_ranks}")
        self.cls, self.role, self.world_size, self.timeout_s = cls, role, num_ranks, timeout_s
        # how `run` splits a batch: over dp ranks, shared by tp ranks and stages
        self.mesh = mesh or RankMesh()
        self._ranks: list[Any] = []  # the worker objects (local) or actor handles (ray), in rank order

    # -----------------------------------------------------------------------------------------------------
    # Calls
    # -----------------------------------------------------------------------------------------------------

    def run(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Call `method` as its `@dispatch` declares (distributed.dispatch): its arguments split over the ranks, the
        ranks' results gathered into one."""
        rule = rule_of(self.cls, method)
        per_rank, rows = split_args(rule, self.mesh, self.world_size, args)
        return gather(rule, self.mesh, self.call_each(method, per_rank, timeout_s=timeout_s), rows)

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Call `method(*args, **kwargs)` on every rank; return the results in rank order."""
        return self.wait(self.call_async(method, *args, **kwargs), timeout_s)

    def call_each(
        self, method: str, args_per_rank: list[tuple[Any, ...]], *, timeout_s: float | None = None
    ) -> list[Any]:
        """Call `method(*args_per_rank[r])` on each rank r (e.g. one data shard per rank); results in rank order."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(
                f"role '{self.role}' {method}(): got {len(args_per_rank)} argument tuples for {self.world_size} ranks"
            )
        futures = [self._submit(r, method, tuple(a), {}) for r, a in enumerate(args_per_rank)]
        return self.wait(futures, timeout_s)

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[RankFuture]:
        """Start `method(*args, **kwargs)` on every rank without waiting; collect with wait()."""
        return [self._submit(r, method, args, kwargs) for r in range(self.world_size)]

    def submit(self, rank: int, method: str, *args: Any, side: bool = False, **kwargs: Any) -> RankFuture:
        """Start `method(*args, **kwargs)` on one rank without waiting; collect with wait() or settle().
        side: (ray) in the class's "side" concurrency group (its `concurrency_groups`), beside a call that runs."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"role '{self.role}' {method}(): no rank {rank} among {self.world_size}")
        return self._submit(rank, method, args, kwargs, side)

    def _submit(
        self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], side: bool = False
    ) -> RankFuture:
        self._running(method)
        if not callable(getattr(self.cls, method, None)):
            raise AttributeError(f"role '{self.role}': {self.cls.__name__} has no method '{method}'")
        if side and "side" not in (getattr(self.cls, "concurrency_groups", None) or {}):
            raise ValueError(f"role '{self.role}': {self.cls.__name__} has no 'side' concurrency group")
        return self._start_call(rank, method, args, kwargs, side)

    def _running(self, what: str) -> None:
        if not self._ranks:
            raise ValueError(f"role '{self.role}' {what}(): the worker group is shut down")

    @abstractmethod
    def _start_call(
        self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], side: bool
    ) -> RankFuture:
        """Start one checked call on one rank."""

    @abstractmethod
    def wait(self, futures: list[RankFuture], timeout_s: float | None = None) -> list[Any]:
        """Results of `futures` in their order; raise at the first failed rank, or when timeout_s runs out.

        timeout_s: None = the group's timeout_s (None there = no limit). The first failure seen is raised
        at once, so a rank that died surfaces even while the others block waiting for it in a collective."""

    def settle(self, futures: list[RankFuture], timeout_s: float | None = None) -> list[Any]:
        """Like wait, but waits for every call and puts a WorkerError in the place of each failed one; a call
        still running at the deadline raises WorkerTimeoutError. For callers that recover from some failures."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        outcomes: list[Any] = []
        for f in futures:
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            try:
                outcomes.append(self.wait([f], left)[0])
            except WorkerTimeoutError:
                raise
            except WorkerError as e:
                outcomes.append(e)
        return outcomes

    def put(self, value: Any) -> Any:
        """`value` as an argument for every rank (one copy in Ray's object store on ray)."""
        return value

    def made(self, futures: list[RankFuture], timeout_s: float | None = None) -> None:
        """Wait until every call of `futures` has ended without fetching their values (ray: their refs can then go
        to other ranks as arguments); a local call has ended when it is submitted."""
        return None

    # -----------------------------------------------------------------------------------------------------
    # The ranks: only a Ray group's can change while it runs
    # -----------------------------------------------------------------------------------------------------

    def start_spares(self) -> None:
        """With standby, start a spare for every rank that has none, without waiting for it (ray)."""
        return None  # a local group has no spares

    def restart_ranks(self, ranks: list[int]) -> None:
        """Replace the actors of `ranks` with new ones in their bundles (ray)."""
        raise self._fixed("restart_rank")

    def restart_rank(self, rank: int) -> None:
        """Replace rank `rank`'s actor (ray; restart_ranks)."""
        self.restart_ranks([rank])

    def add_ranks(self, places: list[tuple[Pool, int]]) -> None:
        """Start one more rank in each (pool, bundle index) of `places` (ray)."""
        raise self._fixed("add_ranks")

    def remove_ranks(self, keep: int) -> list[tuple[Pool, int]]:
        """Stop the ranks from `keep` on; return their places (ray)."""
        raise self._fixed("remove_ranks")

    def places(self) -> list[tuple[Pool, int]]:
        """(pool, bundle index) of every rank, in rank order (ray)."""
        raise self._fixed("places")

    def local(self) -> Any:
        """The worker object of the one rank in this process (local backend), for checks and tests."""
        raise ValueError(f"role '{self.role}': only a running local group has its worker in this process")

    def _fixed(self, what: str) -> ValueError:
        return ValueError(
            f"role '{self.role}' {what}(): the local backend runs one fixed rank in this process"
        )

    # -----------------------------------------------------------------------------------------------------
    # Lifetime
    # -----------------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every rank; safe to call twice."""
        self._ranks = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class LocalGroup(WorkerGroup):
    """One rank in this process, called directly in the caller's thread (the embedded default, no Ray); its
    environment is this process's, as the group found it again once the group stops."""

    def __init__(
        self,
        cls: type,
        *,
        role: str = "worker",
        init_args: tuple[Any, ...] = (),
        init_kwargs: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        timeout_s: float | None = None,
        mesh: RankMesh | None = None,
    ) -> None:
        """Build the worker in this process. env_vars: extra environment (RANK, WORLD_SIZE, ... take precedence).
        timeout_s: kept for the interface; a call in the caller's thread cannot be timed out."""
        super().__init__(cls, 1, role, timeout_s, mesh)
        env = {**(env_vars or {}), **rank_env(0, 1, 0, 1, "127.0.0.1", free_port())}
        self._saved_env = {k: os.environ.get(k) for k in env}  # put back by shutdown()
        os.environ.update(env)
        try:
            self._ranks = [cls(*init_args, **(init_kwargs or {}))]
        except Exception as e:
            self.shutdown()
            raise WorkerError(role, 0, "__init__", f"raised {type(e).__name__}: {e}") from e

    def shutdown(self) -> None:
        """Drop the rank; put back the environment (a notebook that ran a job keeps no RANK); safe twice."""
        super().shutdown()
        os.environ.update({k: v for k, v in self._saved_env.items() if v is not None})
        for k in [k for k, v in self._saved_env.items() if v is None]:
            del os.environ[k]
        self._saved_env = {}

    def _start_call(
        self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], side: bool
    ) -> RankFuture:
        done: Future[Any] = Future()
        try:
            done.set_result(getattr(self._ranks[rank], method)(*args, **kwargs))
        except Exception as e:
            done.set_exception(e)
        return RankFuture(rank, method, done)

    def wait(self, futures: list[RankFuture], timeout_s: float | None = None) -> list[Any]:
        return [self._result(f) for f in futures]

    def _result(self, f: RankFuture) -> Any:
        """The value of one finished call, or its failure as a WorkerError naming role, rank and method."""
        try:
            return f.ref.result()
        except Exception as e:
            raise WorkerError(self.role, f.rank, f.method, f"raised {type(e).__name__}: {e}") from e

    def local(self) -> Any:
        self._running("local")
        return self._ranks[0]


class RayGroup(WorkerGroup):
    """One Ray actor per bundle of the role's pool (placement.place_pools), pinned to its bundle; its ranks can be
    replaced, added and removed while it runs, and can have spares (standby)."""

    def __init__(
        self,
        cls: type,
        num_ranks: int = 1,
        *,
        role: str = "worker",
        pool: Pool | None = None,
        init_args: tuple[Any, ...] = (),
        init_kwargs: dict[str, Any] | None = None,
        env_vars: dict[str, str] | None = None,
        max_restarts: int = 0,
        timeout_s: float | None = None,
        standby: bool = False,
        warm: bool = False,
        mesh: RankMesh | None = None,
        nodes: NodeWatcher | None = None,
    ) -> None:
        """Start the ranks and wait (at most timeout_s) until each has built its worker.

        pool: where rank i goes (bundle i of the pool).
        env_vars: extra environment for every rank (RANK, WORLD_SIZE, ... take precedence).
        max_restarts: passed to Ray's actor options. mesh: the ranks' (pp, dp, tp) shape, for `run` (None: all dp).
        timeout_s: default limit for construction and for every call; None = no limit.
        standby: a spare for every rank, started once the ranks are ready; a restart promotes it. Spares take no
        resources (a GPU rank's spare could not see its GPU, so a pool with GPUs refuses them).
        warm: (with standby) the spares are warm processes: imports paid, constructor run when promoted.
        nodes: the run's NodeWatcher (distributed.nodes): a call waiting on a rank fails as Ray declares its node dead,
        and a rank is replaced only once its bundle sits on a live node (waiting for capacity, if need be).
        """
        super().__init__(cls, num_ranks, role, timeout_s, mesh)
        self._places: list[tuple[Pool, int]] = []  # (pool, bundle index) of each rank
        self._watch, self._at = nodes, cast(list[str], [])  # the node each rank was started on, in rank order
        self._spare_at: dict[int, str] = {}  # rank -> the node its spare was started on
        self._standby: dict[int, Any] | None = {} if standby else None  # rank -> its spare's actor
        self._warm = standby and warm  # the spares are warm processes (warm_class), built when promoted
        self._start_actors(pool, init_args, dict(init_kwargs or {}), dict(env_vars or {}), max_restarts)

    def _start_actors(
        self,
        pool: Pool | None,
        init_args: tuple[Any, ...],
        init_kwargs: dict[str, Any],
        env_vars: dict[str, str],
        max_restarts: int,
    ) -> None:
        import ray

        role, n = self.role, self.world_size
        if not ray.is_initialized():
            raise ValueError(
                f"role '{role}': the ray backend needs Ray running (loopline.distributed.cluster.start_ray)"
            )
        if pool is None:
            raise ValueError(f"role '{role}': the ray backend needs a pool (from placement.place_pools)")
        if n > pool.num_bundles:
            raise ValueError(
                f"role '{role}': {n} ranks but pool '{pool.name}' has {pool.num_bundles} bundles"
            )
        _check_role(role, pool)
        if self._standby is not None and pool.rank_resources().get("GPU", 0.0) > 0:
            raise ValueError(
                f"role '{role}': spare ranks take no resources, so they cannot see the GPUs of pool "
                f"'{pool.name}'; standby needs a pool without GPUs"
            )
        nodes = pool.bundle_nodes()[:n]
        # Rendezvous: rank 0's node, a port free there; a task (a process) asks there off this node or via Ray Client
        if nodes[0] == ray.get_runtime_context().get_node_id() and not ray.util.client.ray.is_connected():
            self._master = master_address()
        else:
            where = in_bundle(pool.placement_group, 0)
            probe = ray.remote(num_cpus=0, scheduling_strategy=where)(master_address).remote()
            self._master = self.wait([RankFuture(0, "<rendezvous probe>", probe)])[0]
        self._spawn = (init_args, init_kwargs, env_vars, max_restarts)
        self._places = [(pool, i) for i in range(n)]
        try:
            for i in range(n):
                self._ranks.append(self._start_rank(i, nodes))
            self._at = list(nodes)
            self._wait_ready(range(n))
            self.start_spares()
        except BaseException:
            self.shutdown()  # no half-started group left behind
            raise

    def _start_rank(self, i: int, nodes: list[str], spare: bool = False) -> Any:
        """Start the actor of rank i in its place (pool, bundle); `nodes` holds the node of every rank's bundle.
        spare: the rank's spare, taking none of the bundle's resources (only its place)."""
        pool, bundle = self._places[i]
        init_args, init_kwargs, env_vars, max_restarts = self._spawn
        addr, port = self._master
        local = rank_env(i, self.world_size, nodes[:i].count(nodes[i]), nodes.count(nodes[i]), addr, port)
        if spare:  # the threads Ray gives the rank it replaces (a spare holds no CPUs)
            local["OMP_NUM_THREADS"] = str(max(1, int(pool.rank_resources().get("CPU", 1.0))))
        warm = spare and self._warm  # a warm process: the class's constructor runs when it is promoted
        return start_actor(
            warm_class(self.cls) if warm else self.cls,
            () if warm else init_args,
            {} if warm else init_kwargs,
            resources={} if spare else pool.rank_resources(),
            bundle=(pool.placement_group, bundle),
            env_vars={**env_vars, **local},
            max_restarts=max_restarts,
        )

    def start_spares(self) -> None:
        """With standby, start a spare for every rank that has none, without waiting for it (ray)."""
        if self._standby is None or not self._ranks:
            return
        nodes = self._nodes()
        for i in range(self.world_size):
            if i not in self._standby:
                self._standby[i], self._spare_at[i] = self._start_rank(i, nodes, spare=True), nodes[i]

    def _wait_ready(self, ranks: range | list[int], warm: list[int] | None = None) -> None:
        """Wait until the actors of `ranks` are built; those of `warm` (warm processes) build now."""
        init_args, init_kwargs = self._spawn[:2]
        self.wait(
            [
                RankFuture(i, "__init__", self._ranks[i].become.remote(*init_args, **init_kwargs))
                if i in (warm or ())
                else RankFuture(i, "__init__", self._ranks[i].__ray_ready__.remote())
                for i in ranks
            ]
        )

    def _nodes(self) -> list[str]:
        """Node id of every rank's bundle, in rank order."""
        by_pool: dict[int, list[str]] = {}
        for pool, _ in self._places:
            if id(pool) not in by_pool:
                by_pool[id(pool)] = pool.bundle_nodes()
        return [by_pool[id(pool)][b] for pool, b in self._places]

    def restart_ranks(self, ranks: list[int]) -> None:
        """restart_rank for each of `ranks`, the new actors starting side by side; with standby, each rank's
        spare takes its place (start_spares starts new ones: after the restart, so as not to slow it down). None
        starts in a bundle on a lost node: the bundles wait to be placed on live nodes first (_placed)."""
        self._running("restart_rank")
        for rank in ranks:
            if not 0 <= rank < self.world_size:
                raise ValueError(f"role '{self.role}': no rank {rank} among {self.world_size}")
        nodes = self._placed(ranks)
        kill(*(self._ranks[r] for r in ranks))
        spares = self._standby if self._standby is not None else {}
        warm: list[int] = []  # ranks promoted from warm processes: their constructors run now
        for rank in ranks:
            # the spare gets no resources back: the killed rank's share of the bundle stays free for the next spare
            if rank in spares and self._spare_at.get(rank) == nodes[rank]:
                self._ranks[rank] = spares.pop(rank)
                warm += [rank] if self._warm else []
            else:  # no spare, or one lost with its node (the bundle is elsewhere now)
                kill(*([spares.pop(rank)] if rank in spares else []))
                self._ranks[rank] = self._start_rank(rank, nodes)
            self._at[rank] = nodes[rank]
        try:
            self._wait_ready(ranks, warm)
        except WorkerDiedError:  # a spare that died meanwhile, or a node lost meanwhile: fresh actors instead
            kill(*(self._ranks[r] for r in ranks))
            nodes = self._placed(ranks)
            for rank in ranks:
                self._ranks[rank], self._at[rank] = self._start_rank(rank, nodes), nodes[rank]
            self._wait_ready(ranks)

    def _placed(self, ranks: list[int]) -> list[str]:
        """The node of every rank's bundle, once those of `ranks` sit on live nodes: with a NodeWatcher, a lost
        node's bundles are waited for until Ray places them again (on the nodes that remain, or one that joins)."""
        if self._watch is not None:
            self._watch.wait_ranks(self.role, [(r, *self._places[r], self._at[r]) for r in ranks])
        return self._nodes()

    def add_ranks(self, places: list[tuple[Pool, int]]) -> None:
        """Start one more rank in each (pool, bundle index) of `places`, as ranks world_size, world_size + 1, ...;
        on failure the new ones are stopped and the group is as before."""
        self._running("add_ranks")
        for pool, _ in places:
            _check_role(self.role, pool)
        first = self.world_size
        self._places += places
        self.world_size += len(places)
        try:
            nodes = self._nodes()
            for i in range(first, self.world_size):
                self._ranks.append(self._start_rank(i, nodes))
                self._at.append(nodes[i])
            self._wait_ready(range(first, self.world_size))
            self.start_spares()
        except BaseException:
            kill(*self._ranks[first:], *self._drop_spares(first))
            del self._ranks[first:], self._places[first:], self._at[first:]
            self.world_size = first
            raise

    def remove_ranks(self, keep: int) -> list[tuple[Pool, int]]:
        """Stop the ranks from `keep` on (their actors are killed); return their places, last rank last."""
        self._running("remove_ranks")
        if not 1 <= keep <= self.world_size:
            raise ValueError(
                f"role '{self.role}': cannot keep {keep} of {self.world_size} ranks (1 at least)"
            )
        kill(*self._ranks[keep:], *self._drop_spares(keep))
        removed = self._places[keep:]
        del self._ranks[keep:], self._places[keep:], self._at[keep:]
        self.world_size = keep
        return removed

    def _drop_spares(self, first: int) -> list[Any]:
        """The spares of ranks `first` on, forgotten (the caller kills them)."""
        if self._standby is None:
            return []
        return [self._standby.pop(r) for r in sorted(self._standby) if r >= first]

    def places(self) -> list[tuple[Pool, int]]:
        """(pool, bundle index) of every rank, in rank order."""
        return list(self._places)

    def put(self, value: Any) -> Any:
        import ray

        return ray.put(value)

    def _start_call(
        self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], side: bool
    ) -> RankFuture:
        call = getattr(self._ranks[rank], method)
        call = call.options(concurrency_group="side") if side else call
        return RankFuture(rank, method, call.remote(*args, **kwargs))

    def wait(self, futures: list[RankFuture], timeout_s: float | None = None) -> list[Any]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = {f.ref: i for i, f in enumerate(futures)}
        results: dict[int, Any] = {}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = finished(list(pending), self._slice(left))
            if not ready:
                self._check_nodes([futures[i] for i in pending.values()])
            if not ready and (deadline is None or time.monotonic() < deadline):
                continue  # a slice ended; or Ray rounded the timeout to milliseconds and returned a little early
            if not ready:
                stuck = [futures[i] for i in sorted(pending.values())]
                also = ", ".join(f"rank {f.rank} {f.method}()" for f in stuck[1:])
                raise WorkerTimeoutError(
                    self.role,
                    stuck[0].rank,
                    stuck[0].method,
                    f"did not finish within {timeout_s:g}s"
                    + (f" (also still running: {also})" if also else ""),
                )
            for ref in ready:
                i = pending.pop(ref)
                results[i] = self._result(futures[i])
        return [results[i] for i in range(len(futures))]

    def made(self, futures: list[RankFuture], timeout_s: float | None = None) -> None:
        """Wait (at most timeout_s, None = the group's) until every call of `futures` has ended, without fetching
        their values: their refs can then go to other ranks as arguments. A failure shows where it is used."""
        if not futures:
            return
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = [f.ref for f in futures]
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = finished(pending, self._slice(left), fetch=False)
            if not done:
                self._check_nodes([f for f in futures if f.ref in pending])
            if not done and deadline is not None and time.monotonic() >= deadline:
                f = futures[[x.ref for x in futures].index(pending[0])]
                raise WorkerTimeoutError(self.role, f.rank, f.method, f"did not finish within {timeout_s:g}s")
            pending = [r for r in pending if r not in done]

    def _slice(self, left: float | None) -> float | None:
        """How long one wait for results may block: with a NodeWatcher, a second at most, so that a call on a rank
        whose node Ray declares dead fails then (_check_nodes), not at its timeout."""
        return left if self._watch is None else min(1.0, 1.0 if left is None else left)

    def _check_nodes(self, futures: list[RankFuture]) -> None:
        """Raise WorkerDiedError for the first of `futures` whose rank's node Ray has declared dead."""
        for f in futures if self._watch is not None else ():
            node = self._at[f.rank] if f.rank < len(self._at) else ""
            if node and self._watch.dead(node):
                raise WorkerDiedError(self.role, f.rank, f.method, f"the rank's node {node[:8]} was lost")

    def _result(self, f: RankFuture) -> Any:
        """The value of one finished call, or its failure as a WorkerError naming role, rank and method."""
        try:
            return get(f.ref)
        except ActorRaised as e:
            method = "__init__" if e.in_init else f.method
            raise WorkerError(self.role, f.rank, method, f"raised {e}") from e.__cause__
        except ActorGone as e:
            raise WorkerDiedError(self.role, f.rank, f.method, f"the rank's actor {e}") from e.__cause__

    def shutdown(self) -> None:
        """Stop every rank (Ray actors are killed, without restart); safe to call twice."""
        kill(*self._ranks, *self._drop_spares(0))
        self._ranks, self._at = [], []
