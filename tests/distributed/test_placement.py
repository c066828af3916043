"""Placement: the resource check names role, pool and shortfall; placement groups fail fast instead of hanging.

The arithmetic is tested as a pure function over per-node free resources. The rest runs on the session's real
local Ray (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import ray
from pydantic import ValidationError

from loopline.distributed.placement import (
    PlacementConfig,
    PlacementError,
    Pool,
    PoolConfig,
    check_placement,
    cluster_free_resources,
    place_pools,
    remove_pools,
)


def _cfg(
    pools: list[tuple[str, int, dict[str, float]]], roles: dict[str, str], **kw: object
) -> PlacementConfig:
    return PlacementConfig(
        pools=[PoolConfig(name=n, bundles=b, resources=r) for n, b, r in pools], roles=roles, **kw
    )


def _error(cfg: PlacementConfig, nodes: list[dict[str, float]]) -> str:
    with pytest.raises(PlacementError) as e:
        check_placement(cfg, nodes)
    return str(e.value)


# ---------------------------------------------------------------------------------------------------------
# The check, as arithmetic
# ---------------------------------------------------------------------------------------------------------


def test_missing_gpu_names_role_pool_and_shortfall() -> None:
    cfg = _cfg([("train", 1, {"CPU": 1}), ("gen", 4, {"GPU": 1})], {"actor": "train", "rollout": "gen"})
    msg = _error(cfg, [{"CPU": 2}])
    assert "role 'rollout' (pool 'gen') needs 4 x {GPU: 1} = GPU 4, cluster has GPU 0" in msg
    assert "actor" not in msg  # the pool that fits is not blamed


def test_colocated_roles_are_all_named_and_every_short_pool_is_listed() -> None:
    cfg = _cfg(
        [("train", 4, {"CPU": 2, "trainer": 1}), ("env", 3, {"env_node": 1})],
        {"actor": "train", "ref": "train", "env": "env"},
    )
    msg = _error(cfg, [{"CPU": 4, "trainer": 4}, {"CPU": 1, "env_node": 2}])
    assert (
        "pool 'train' (colocated roles 'actor', 'ref') needs 4 x {CPU: 2, trainer: 1} = CPU 8, cluster has CPU 5"
        in msg
    )
    assert "role 'env' (pool 'env') needs 3 x {env_node: 1} = env_node 3, cluster has env_node 2" in msg


def test_bundle_larger_than_any_node_fails_even_when_the_total_suffices() -> None:
    cfg = _cfg([("big", 1, {"CPU": 3})], {"actor": "big"})
    msg = _error(cfg, [{"CPU": 2}, {"CPU": 2}])
    assert "role 'actor' (pool 'big') needs 1 x {CPU: 3}, but a bundle must fit on one node" in msg
    assert "hold only 0" in msg


def test_strategies_strict_spread_and_strict_pack() -> None:
    nodes = [{"CPU": 4}, {"CPU": 1}]
    spread = _cfg([("p", 3, {"CPU": 1})], {"env": "p"})
    spread.pools[0].strategy = "STRICT_SPREAD"
    assert "STRICT_SPREAD: 3 bundles of {CPU: 1} need 3 nodes, only 2 node(s)" in _error(spread, nodes)
    pack = _cfg([("p", 5, {"CPU": 1})], {"env": "p"})
    pack.pools[0].strategy = "STRICT_PACK"
    assert (
        "STRICT_PACK: all 5 bundles of {CPU: 1} must fit on one node, the most any node holds is 4"
        in _error(pack, nodes)
    )
    pack.pools[0].strategy = "PACK"
    check_placement(pack, nodes)  # 4 + 1 bundles across the two nodes


def test_pools_that_fit_alone_but_not_together() -> None:
    cfg = _cfg([("train", 2, {"CPU": 2}), ("env", 2, {"CPU": 1})], {"actor": "train", "env": "env"})
    msg = _error(cfg, [{"CPU": 4}, {"CPU": 1}])
    assert (
        "pools together need CPU 6 (role 'actor' (pool 'train') 4, role 'env' (pool 'env') 2), cluster has CPU 5"
        in msg
    )


def test_heterogeneous_request_that_fits_passes() -> None:
    cfg = _cfg(
        [
            ("train", 2, {"trainer": 1}),
            ("gen", 1, {"gen": 1, "CPU": 1}),
            ("env", 2, {"env_node": 1, "CPU": 0.5}),
        ],
        {"actor": "train", "ref": "train", "rollout": "gen", "env": "env"},
    )
    check_placement(cfg, [{"trainer": 2, "CPU": 1}, {"gen": 1, "CPU": 1}, {"env_node": 2, "CPU": 1}])


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="role 'rollout' names pool 'gen', which is not defined"):
        _cfg([("train", 1, {"CPU": 1})], {"actor": "train", "rollout": "gen"})
    with pytest.raises(ValidationError, match="'spare'.* used by no role"):
        _cfg([("train", 1, {"CPU": 1}), ("spare", 1, {"CPU": 1})], {"actor": "train"})
    with pytest.raises(ValidationError, match="repeated: train"):
        _cfg([("train", 1, {"CPU": 1}), ("train", 2, {"CPU": 1})], {"actor": "train"})
    with pytest.raises(ValidationError, match="roles.trainer"):
        _cfg([("train", 1, {"CPU": 1})], {"trainer": "train"})
    with pytest.raises(ValidationError, match="must be > 0"):
        _cfg([("train", 1, {"GPU": 0})], {"actor": "train"})
    with pytest.raises(ValidationError, match="bundles"):
        PoolConfig(name="p", bundles=0)


def test_colocated_roles_split_each_bundle() -> None:
    pool = Pool(
        "p",
        placement_group=None,
        bundle={"CPU": 1.0, "GPU": 1.0},
        num_bundles=2,
        roles=("actor", "ref", "critic"),
    )  # type: ignore[arg-type]
    share = pool.rank_resources()
    assert share == {"CPU": 0.3333, "GPU": 0.3333}
    assert 3 * share["GPU"] <= 1.0  # the three roles' ranks fit in one bundle


# ---------------------------------------------------------------------------------------------------------
# On a real Ray
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_ray(ray_cluster) -> float:
    """The session's Ray (tests/conftest.py); its number of CPUs."""
    return ray.cluster_resources()["CPU"]


def _live_groups() -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_impossible_request_fails_at_once_naming_the_role(local_ray: float) -> None:
    # ready_timeout_s far beyond the test's own timeout: only the up-front check can end this in time
    cfg = _cfg([("gen", 4, {"GPU": 1})], {"rollout": "gen"}, ready_timeout_s=86400)
    with pytest.raises(
        PlacementError, match=r"role 'rollout' \(pool 'gen'\) needs 4 x \{GPU: 1\} = GPU 4, cluster has GPU 0"
    ):
        place_pools(cfg)
    assert _live_groups() == []


def test_unchecked_request_times_out_with_the_pool_named(local_ray: float) -> None:
    # As on an autoscaling cluster: no check, so Ray waits, and ready_timeout_s bounds the wait (the message
    # says it was that bound that ended it).
    cfg = _cfg([("gen", 2, {"tpu_v5": 1})], {"rollout": "gen"}, check_resources=False, ready_timeout_s=1.5)
    with pytest.raises(PlacementError, match=r"role 'rollout' \(pool 'gen'\) was not placed within 1.5s"):
        place_pools(cfg)
    assert _live_groups() == []


def test_place_and_remove_pools(local_ray: float) -> None:
    cpus = local_ray
    cfg = _cfg(
        [("train", 1, {"CPU": cpus - 1}), ("env", 2, {"CPU": 0.5})],
        {"actor": "train", "ref": "train", "env": "env"},
    )
    pools = place_pools(cfg)
    try:
        assert pools["actor"] is pools["ref"]  # colocated: one pool, one placement group
        assert pools["env"].num_bundles == 2 and pools["env"].roles == ("env",)
        # all reserved; the per-node view lags the reservation on a loaded machine (seen: 1 CPU still free)
        deadline = time.monotonic() + 10
        while sum(n.get("CPU", 0.0) for n in cluster_free_resources()) > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        free = cluster_free_resources()
        assert sum(n.get("CPU", 0.0) for n in free) == pytest.approx(0.0)
        assert not any("_group_" in k for n in free for k in n)
        # The cluster is now full: a further pool fails at once.
        with pytest.raises(PlacementError, match="cluster has CPU 0"):
            place_pools(_cfg([("more", 1, {"CPU": 1})], {"critic": "more"}))
    finally:
        remove_pools(pools)
    deadline = time.monotonic() + 10
    while sum(n.get("CPU", 0.0) for n in cluster_free_resources()) < cpus and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(n.get("CPU", 0.0) for n in cluster_free_resources()) == pytest.approx(cpus)


_HOLDER = """
import os, signal, sys, time
import ray
from ray.util.placement_group import placement_group
ray.init(address=sys.argv[1])
group = placement_group([{"CPU": float(sys.argv[2])}])
assert group.wait(30)
print("held", flush=True)
sys.stdin.readline()
time.sleep(1.5)
os.kill(os.getpid(), signal.SIGKILL)  # dies like a killed run: its group is freed only once Ray notices
"""


def test_a_pool_held_by_a_dying_job_is_placed_once_that_job_is_gone(local_ray: float) -> None:
    """Resuming a run killed a moment ago: the check waits while another job holds the CPUs, and names that
    job's groups when its wait ends first."""
    cpus = local_ray
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, ray.get_runtime_context().gcs_address, str(cpus)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        cfg = _cfg([("train", 1, {"CPU": 1})], {"actor": "train"})
        with pytest.raises(
            PlacementError, match=r"cluster has CPU 0\n.*other Ray jobs hold placement groups; waited 1s"
        ):
            place_pools(cfg.model_copy(update={"ready_timeout_s": 1.0}))
        holder.stdin.write("go\n")
        holder.stdin.flush()
        start = time.monotonic()
        pools = place_pools(cfg)  # the holder is still alive for 1.5 s, then killed
        assert time.monotonic() - start > 1.0
        remove_pools(pools)
    finally:
        holder.kill()
        holder.wait(30)


def test_cpus_held_outside_any_group_are_waited_for_then_named(local_ray: float) -> None:
    """An actor outside any placement group holds a CPU (as one ending, or a view not yet updated, does): the check
    waits, fails naming that if the CPU stays held, and places the pool once the actor is gone."""
    cpus = local_ray

    @ray.remote(num_cpus=1)
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(holder.ready.remote(), timeout=60)
        cfg = _cfg([("all", 1, {"CPU": cpus})], {"actor": "all"}, ready_timeout_s=1.0)
        with pytest.raises(PlacementError, match=r"resources not in any placement group are held.*waited 1s"):
            place_pools(cfg)
        threading.Timer(1.0, ray.kill, args=(holder,)).start()
        start = time.monotonic()
        pools = place_pools(cfg.model_copy(update={"ready_timeout_s": 60.0}))
        assert time.monotonic() - start > 0.5
        remove_pools(pools)
    finally:
        ray.kill(holder)
