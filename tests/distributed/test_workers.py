"""Worker groups on a real multi-node Ray on this machine: the session's Ray plus nodes added for this file.

Nodes added to the session's head (tests/conftest.py): a trainer node {trainer: 2}, a gen node {gen: 1} and
an env node {env_node: 2}, one CPU each. Checks that ranks land on the node their pool asks for, that ranks
of a ray group form a real gloo process group, that the local and ray backends agree, and that a stuck or dead rank surfaces
as an error naming role, rank and method within a bounded time.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import ray
import ray.cloudpickle

from loopline.distributed.placement import PlacementConfig, Pool, PoolConfig, place_pools, remove_pools
from loopline.distributed.workers import (
    LocalGroup,
    RayGroup,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
)

LIMIT_S = 60.0  # no group in these tests may wait longer than this for anything


# ---------------------------------------------------------------------------------------------------------
# Worker classes: plain Python classes, as a role's worker would be
# ---------------------------------------------------------------------------------------------------------


class Probe:
    """Reports where its rank runs and what environment it was given."""

    def where(self) -> dict[str, str]:
        env = {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TAG")}
        return {"node": ray.get_runtime_context().get_node_id(), **env}

    def all_reduce(self, value: float) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")  # env:// rendezvous from RANK, WORLD_SIZE, MASTER_ADDR/PORT
        try:
            t = torch.tensor([value, 1.0])
            dist.all_reduce(t)  # sum over ranks
            return {
                "rank": dist.get_rank(),
                "world": dist.get_world_size(),
                "sum": t[0].item(),
                "n": t[1].item(),
            }
        finally:
            dist.destroy_process_group()

    def nap(self, seconds_on_rank_1: float) -> str:
        if os.environ["RANK"] == "1":
            time.sleep(seconds_on_rank_1)
        return "awake"

    def threads(self, asked: int) -> int:
        import torch

        from loopline.runtime.ranks import use_threads

        use_threads(asked)
        return torch.get_num_threads()

    def pid(self) -> int:
        return os.getpid()

    def exit_on_rank(self, rank: int) -> str:
        if os.environ["RANK"] == str(rank):
            os._exit(1)  # the process dies, as on an OOM kill or a segfault
        return "alive"


class Sider(Probe):
    """A Probe that answers calls of its "side" concurrency group while a call of its own runs."""

    concurrency_groups = {"side": 1}


class Accumulator:
    """Stateful arithmetic: the same calls must give the same results on either backend."""

    def __init__(self, start: float, scale: float = 1.0) -> None:
        self.total, self.scale = start, scale

    def add(self, x: float, times: int = 1) -> float:
        self.total += self.scale * x * times
        return self.total

    def rank_info(self) -> tuple[str, str]:
        return os.environ["RANK"], os.environ["WORLD_SIZE"]

    def fail(self, why: str) -> None:
        raise ValueError(why)


class Built(Accumulator):
    """An Accumulator that says in which process its constructor ran."""

    def __init__(self, start: float) -> None:
        super().__init__(start)
        self.built_in = os.getpid()

    def built(self) -> tuple[int, int]:
        return self.built_in, os.getpid()

    def pid(self) -> int:
        return os.getpid()


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("no weights at /nowhere")


# ---------------------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(add_ray_nodes) -> dict[str, str]:
    """Add the 3 nodes to the session's Ray (tests/conftest.py); return node id by custom resource."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test file
    names = ["trainer", "gen", "env_node"]
    ids = add_ray_nodes([{"CPU": 1, "trainer": 2}, {"CPU": 1, "gen": 1}, {"CPU": 1, "env_node": 2}])
    return dict(zip(names, ids, strict=True))


def _place(pools: list[tuple[str, int, dict[str, float]]], roles: dict[str, str]) -> dict[str, Pool]:
    cfg = PlacementConfig(
        pools=[PoolConfig(name=n, bundles=b, resources=r) for n, b, r in pools],
        roles=roles,
        ready_timeout_s=LIMIT_S,
    )
    return place_pools(cfg)


# ---------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------


def test_heterogeneous_placement(cluster: dict[str, str]) -> None:
    pools = _place(
        [("train", 2, {"trainer": 1}), ("gen", 1, {"gen": 1}), ("env", 2, {"env_node": 1})],
        {"actor": "train", "ref": "train", "rollout": "gen", "env": "env"},
    )
    groups = {
        role: RayGroup(Probe, n, role=role, pool=pools[role], env_vars={"TAG": role}, timeout_s=LIMIT_S)
        for role, n in [("actor", 2), ("ref", 2), ("rollout", 1), ("env", 2)]
    }
    try:
        where = {role: g.call("where") for role, g in groups.items()}
    finally:
        for g in groups.values():
            g.shutdown()
        remove_pools(pools)

    expected_node = {"actor": "trainer", "ref": "trainer", "rollout": "gen", "env": "env_node"}
    for role, ranks in where.items():
        assert [r["node"] for r in ranks] == [cluster[expected_node[role]]] * len(ranks), role
        assert [r["RANK"] for r in ranks] == [str(i) for i in range(len(ranks))]
        assert [r["LOCAL_RANK"] for r in ranks] == [
            str(i) for i in range(len(ranks))
        ]  # one node per role here
        assert {r["WORLD_SIZE"] for r in ranks} == {str(len(ranks))}
        assert {r["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}
        assert {r["TAG"] for r in ranks} == {role}
    # actor and ref are colocated: each took half of each {trainer: 1} bundle.
    assert pools["actor"] is pools["ref"] and pools["ref"].rank_resources() == {"trainer": 0.5}


def test_ray_ranks_all_reduce_over_gloo(cluster: dict[str, str]) -> None:
    pools = _place([("train", 2, {"trainer": 1})], {"actor": "train"})
    try:
        with RayGroup(Probe, 2, role="actor", pool=pools["actor"], timeout_s=LIMIT_S) as group:
            out = group.call_each("all_reduce", [(10.0,), (32.0,)])
    finally:
        remove_pools(pools)
    assert out == [{"rank": r, "world": 2, "sum": 42.0, "n": 2.0} for r in range(2)]


def test_a_ray_rank_takes_the_threads_asked_at_most_its_cpus(cluster: dict[str, str]) -> None:
    """threads=2 in a rank given one CPU (or half of one) runs one thread, in a rank given two, two; a process
    that is not a Ray actor takes what it asks."""
    import torch

    from loopline.runtime.ranks import use_threads

    pools = _place([("one", 1, {"CPU": 1}), ("half", 1, {"CPU": 0.5}), ("two", 1, {"CPU": 2})],
                   {"actor": "one", "ref": "half", "critic": "two"})  # fmt: skip
    try:
        got = {}
        for role in ("actor", "ref", "critic"):
            with RayGroup(Probe, 1, role=role, pool=pools[role], timeout_s=LIMIT_S) as group:
                got[role] = group.call_each("threads", [(2,)])[0]
    finally:
        remove_pools(pools)
    assert got == {"actor": 1, "ref": 1, "critic": 2}
    before = torch.get_num_threads()
    try:
        use_threads(3)
        assert torch.get_num_threads() == 3
        use_threads(0)  # torch's default: left as it is
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_local_backend_matches_ray_backend(cluster: dict[str, str]) -> None:
    def run(group: WorkerGroup) -> list:
        with group:
            results = [
                group.call("rank_info"),
                group.call("add", 2.0),
                group.call("add", 0.5, times=4),
                group.call_each("add", [(-1.0,)]),
                group.wait(group.call_async("add", 10.0), timeout_s=LIMIT_S),
            ]
            with pytest.raises(
                WorkerError, match=r"role 'critic' rank 0 fail\(\): raised ValueError: bad batch"
            ) as e:
                group.call("fail", "bad batch")
            assert isinstance(e.value.__cause__, ValueError) and (e.value.rank, e.value.method) == (0, "fail")
            with pytest.raises(AttributeError, match="role 'critic': Accumulator has no method 'nope'"):
                group.call("nope")
            return results

    local = run(LocalGroup(Accumulator, role="critic", init_args=(1.0,), init_kwargs={"scale": 3.0}))
    pools = _place([("gen", 1, {"gen": 1})], {"critic": "gen"})
    try:
        remote = run(
            RayGroup(
                Accumulator,
                role="critic",
                pool=pools["critic"],
                init_args=(1.0,),
                init_kwargs={"scale": 3.0},
                timeout_s=LIMIT_S,
            )
        )
        with pytest.raises(
            WorkerError,
            match=r"role 'critic' rank 0 __init__\(\): raised RuntimeError: no weights at /nowhere",
        ):
            RayGroup(Broken, role="critic", pool=pools["critic"], timeout_s=LIMIT_S)
    finally:
        remove_pools(pools)
    with pytest.raises(
        WorkerError, match=r"role 'critic' rank 0 __init__\(\): raised RuntimeError: no weights"
    ):
        LocalGroup(Broken, role="critic")

    assert local == remote == [[("0", "1")], [7.0], [13.0], [10.0], [40.0]]


def test_stuck_rank_times_out_naming_role_rank_method(cluster: dict[str, str]) -> None:
    pools = _place([("env", 2, {"env_node": 1})], {"env": "env"})
    try:
        with RayGroup(Probe, 2, role="env", pool=pools["env"], timeout_s=LIMIT_S) as group:
            assert group.call("nap", 0.0) == ["awake", "awake"]
            futures = group.call_async("nap", 600.0)
            t0 = time.monotonic()
            with pytest.raises(
                WorkerTimeoutError, match=r"role 'env' rank 1 nap\(\): did not finish within 1.5s"
            ) as e:
                group.wait(futures, timeout_s=1.5)
            assert time.monotonic() - t0 >= 1.5  # it waited its timeout (no upper bound: a loaded machine)
            assert (e.value.role, e.value.rank, e.value.method) == ("env", 1, "nap")
            assert isinstance(e.value, TimeoutError)
        # leaving the block killed the stuck actor instead of waiting 600 s for it
    finally:
        remove_pools(pools)


def test_a_side_call_is_answered_while_the_ranks_own_call_hangs(cluster: dict[str, str]) -> None:
    """What a healing driver relies on (ActorWorker.replica_info): a call in the class's side concurrency group runs
    beside a call that hangs, while the rank's other calls still queue behind it."""
    pools = _place([("env", 2, {"env_node": 1})], {"env": "env"})
    try:
        with RayGroup(Sider, 2, role="env", pool=pools["env"], timeout_s=LIMIT_S) as group:
            group.call_async("nap", 600.0)  # rank 1 sleeps in it
            assert group.wait([group.submit(1, "where", side=True)], timeout_s=LIMIT_S)[0]["RANK"] == "1"
            with pytest.raises(WorkerTimeoutError, match=r"rank 1 where\(\)"):
                group.wait([group.submit(1, "where")], timeout_s=1.0)
    finally:
        remove_pools(pools)
    with pytest.raises(ValueError, match="Accumulator has no 'side' concurrency group"):
        LocalGroup(Accumulator, init_args=(0.0,)).submit(0, "add", 1.0, side=True)


def test_dead_rank_is_reported_by_role_and_rank(cluster: dict[str, str]) -> None:
    pools = _place([("env", 2, {"env_node": 1})], {"env": "env"})
    try:
        with RayGroup(Probe, 2, role="env", pool=pools["env"], timeout_s=LIMIT_S) as group:
            # reported as a death (WorkerDiedError), not found out by the group's 60 s timeout
            with pytest.raises(
                WorkerDiedError, match=r"role 'env' rank 1 exit_on_rank\(\): the rank's actor died"
            ):
                group.call("exit_on_rank", 1)
            with pytest.raises(WorkerDiedError, match=r"role 'env' rank 1 where\(\)"):
                group.call("where")  # rank 0 still answers; rank 1 stays dead (no restarts asked for)
    finally:
        remove_pools(pools)


def test_a_running_group_replaces_adds_and_removes_ranks(cluster: dict[str, str]) -> None:
    pools = _place([("env", 2, {"env_node": 1})], {"env": "env"})
    extra = _place([("gen", 1, {"gen": 1})], {"env": "gen"})  # a one-bundle pool elsewhere, as resize makes
    try:
        with RayGroup(Probe, 1, role="env", pool=pools["env"], timeout_s=LIMIT_S) as group:
            group.add_ranks([(pools["env"], 1)])  # the pool's free bundle
            assert group.world_size == 2 and group.places() == [(pools["env"], 0), (pools["env"], 1)]
            # settle: every outcome, a dead rank's as a WorkerDiedError in its place
            outcomes = group.settle(group.call_async("exit_on_rank", 1))
            assert outcomes[0] == "alive" and isinstance(outcomes[1], WorkerDiedError)
            group.restart_rank(1)  # a new actor in bundle 1, with rank 1's environment
            assert [w["RANK"] for w in group.call("where")] == ["0", "1"]
            group.add_ranks([(extra["env"], 0)])
            where = group.call("where")
            assert [w["RANK"] for w in where] == ["0", "1", "2"] and where[2]["node"] == cluster["gen"]
            assert group.remove_ranks(1) == [(pools["env"], 1), (extra["env"], 0)]
            assert group.world_size == 1 and group.call("nap", 0.0) == ["awake"]
            with pytest.raises(ValueError, match="cannot keep 0 of 1 ranks"):
                group.remove_ranks(0)
    finally:
        remove_pools(pools)
        remove_pools(extra)
    with pytest.raises(ValueError, match="the local backend runs one fixed rank"):
        LocalGroup(Accumulator, role="critic", init_args=(1.0,)).add_ranks([])


def test_spares_take_the_places_of_restarted_ranks(cluster: dict[str, str]) -> None:
    """standby: each rank has a spare in its bundle, built, holding none of the bundle's resources (a bundle of
    {trainer: 1} has none left beside its rank); restart_ranks promotes them (their processes answer as the ranks,
    with the ranks' environment, on the ranks' node), start_spares starts new ones, shutdown stops them all."""
    pools = _place([("trainer", 2, {"trainer": 1})], {"actor": "trainer"})
    try:
        with RayGroup(Probe, 2, role="actor", pool=pools["actor"], timeout_s=LIMIT_S, standby=True) as group:
            ranks = group.call("pid")
            spares = [group._standby[r] for r in (0, 1)]  # started once the ranks were ready
            spare_pids = ray.get([s.pid.remote() for s in spares], timeout=LIMIT_S)
            assert not set(spare_pids) & set(ranks)
            group.restart_ranks([0, 1])
            assert group.call("pid") == spare_pids  # no process started: the spares are the ranks now
            where = group.call("where")
            assert [w["RANK"] for w in where] == ["0", "1"] and {w["node"] for w in where} == {
                cluster["trainer"]
            }
            assert group._standby == {}
            group.start_spares()
            new = ray.get([group._standby[r].pid.remote() for r in (0, 1)], timeout=LIMIT_S)
            assert not set(new) & {*ranks, *spare_pids}
            group.restart_ranks([1])  # one rank: its spare alone is promoted
            assert group.call("pid") == [spare_pids[0], new[1]] and list(group._standby) == [0]
            kept = group._standby[0]
        deadline = time.monotonic() + LIMIT_S
        with pytest.raises(
            ray.exceptions.RayActorError
        ):  # shutdown stopped the spare too (ray.kill is async)
            while time.monotonic() < deadline:
                ray.get(kept.pid.remote(), timeout=LIMIT_S)
                time.sleep(0.1)
    finally:
        remove_pools(pools)


def test_warm_spares_build_the_ranks_they_replace(cluster: dict[str, str]) -> None:
    """standby with warm: each rank's spare is a warm process (its class's module imported, no constructor run, no
    state held); restart_ranks builds each rank in its spare's process, with the rank's arguments and environment."""
    pools = _place([("trainer", 2, {"trainer": 1})], {"actor": "trainer"})
    try:
        with RayGroup(
            Built, 2, role="actor", pool=pools["actor"], init_args=(5.0,), timeout_s=LIMIT_S,
            standby=True, warm=True,
        ) as group:  # fmt: skip
            assert group.call("add", 1.0) == [6.0, 6.0]
            spares = [group._standby[r] for r in (0, 1)]
            spare_pids = ray.get([s.pid.remote() for s in spares], timeout=LIMIT_S)
            with pytest.raises(ray.exceptions.RayTaskError, match="built_in"):  # nothing built yet
                ray.get(spares[0].built.remote(), timeout=LIMIT_S)
            group.restart_ranks([0, 1])
            assert group.call("built") == [(p, p) for p in spare_pids]  # built now, in the spares' processes
            assert group.call("add", 1.0) == [6.0, 6.0]  # from the ranks' own arguments
            assert group.call("rank_info") == [("0", "2"), ("1", "2")]
            assert group._standby == {}
            group.start_spares()  # warm ones again
            with pytest.raises(ray.exceptions.RayTaskError, match="built_in"):
                ray.get(group._standby[1].built.remote(), timeout=LIMIT_S)
    finally:
        remove_pools(pools)


class Failing:
    def __init__(self) -> None:
        raise ValueError("no such model")


@pytest.mark.unit
def test_a_local_group_puts_the_environment_back_when_it_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A local rank sees RANK, WORLD_SIZE, MASTER_* (and its env_vars) while it runs; once the group stops (or its
    constructor raised), this process's environment is as it was: a notebook that ran a job keeps none of them."""
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")  # the user's own, put back as it was
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TAG", raising=False)
    before = dict(os.environ)
    group = LocalGroup(Probe, role="probe", env_vars={"TAG": "x"})
    assert (os.environ["RANK"], os.environ["MASTER_ADDR"], os.environ["TAG"]) == ("0", "127.0.0.1", "x")
    group.shutdown()
    assert dict(os.environ) == before
    group.shutdown()  # twice is harmless
    assert dict(os.environ) == before
    with pytest.raises(WorkerError, match="no such model"):
        LocalGroup(Failing, role="broken")
    assert dict(os.environ) == before
