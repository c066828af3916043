"""A Ray node lost under a worker group: the session's Ray plus nodes added (and removed without grace) here.

A node removed with `remove_node(node, allow_graceful=False)` loses its raylet and every process on it at once, as a
preempted VM does. The NodeWatcher (distributed.nodes) tells it gone at once (its raylet refuses) and dead once Ray
declares it (the test cluster's health checks: ~3 s); a call waiting on a rank there fails long before its timeout;
a replacement rank starts only once its bundle sits on a live node: at once where Ray placed it again on a node with
room, after a wait (saying so) where a node joins, and never past the capacity wait (WorkersLost, one line).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported

import pytest
import ray
import ray.cloudpickle

from loopline.distributed.nodes import NodeWatcher
from loopline.distributed.placement import PlacementConfig, Pool, PoolConfig, place_pools, remove_pools
from loopline.distributed.workers import RayGroup, WorkerDiedError
from loopline.errors import WorkersLost

LIMIT_S = 60.0  # the calls' timeout: every loss below must surface well before it
RESOURCE = "lost_node"  # only the nodes of this file carry it


class Sleeper:
    """A rank that says where it runs and can be kept busy."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


@pytest.fixture
def nodes(ray_cluster) -> Iterator[Callable[[int], dict[str, object]]]:
    """`add(n)`: n nodes of {RESOURCE: n... } added to the session's Ray, by node id; all removed after the test
    (those the test removed itself too)."""
    from loopline.distributed.cluster import _loopback

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test file
    added: list = []

    def add(count: int, per_node: float = 1.0) -> dict[str, object]:
        new = []
        with _loopback():
            for _ in range(count):
                new.append(
                    ray_cluster.add_node(
                        num_cpus=0,
                        resources={RESOURCE: per_node},
                        object_store_memory=80 * 2**20,
                        node_ip_address="127.0.0.1",
                    )
                )
            ray_cluster.wait_for_nodes()
        added.extend(new)
        return {node.node_id: node for node in new}

    yield add
    for node in added:
        if node in ray_cluster.worker_nodes:
            ray_cluster.remove_node(node)


def _pool(strategy: str) -> dict[str, Pool]:
    cfg = PlacementConfig(
        pools=[PoolConfig(name="trainer", bundles=2, resources={RESOURCE: 1}, strategy=strategy)],
        roles={"actor": "trainer"},
        ready_timeout_s=LIMIT_S,
    )
    return place_pools(cfg)


def test_a_lost_node_fails_the_call_at_once_and_its_rank_waits_for_capacity_then_for_a_node_that_joins(
    ray_cluster, nodes
) -> None:
    """STRICT_SPREAD (one bundle per node) over two nodes; the node of rank 1 is lost while both ranks are in a
    call of 100 s: the call fails within seconds naming rank 1 and its node; a replacement with no room waits, says
    what for, and gives up with WorkersLost past the capacity wait (the group as it was); once a node joins, Ray
    places the bundle there and the replacement runs on it."""
    cluster = nodes(2)
    lines: list[str] = []
    watcher = NodeWatcher(capacity_wait_s=6.0, resume_hint="resume it", say=lines.append)
    pools = _pool("STRICT_SPREAD")
    try:
        group = RayGroup(Sleeper, 2, role="actor", pool=pools["actor"], timeout_s=LIMIT_S, nodes=watcher)
        at = group.call("node")
        assert sorted(at) == sorted(cluster)  # one rank per node
        busy = group.call_async("sleep", 100.0)
        t0 = time.monotonic()
        ray_cluster.remove_node(cluster[at[1]], allow_graceful=False)
        assert watcher.gone(at[1]) and not watcher.gone(
            at[0]
        )  # its raylet refuses before Ray declares it dead
        with pytest.raises(WorkerDiedError, match="role 'actor' rank 1 sleep") as died:
            group.wait(busy)
        assert time.monotonic() - t0 < 20.0, died.value  # not at the 60 s timeout
        while not watcher.dead(at[1]):  # Ray's verdict, as the watcher reads it (at most once a second)
            assert time.monotonic() - t0 < 30.0, "Ray did not declare the node dead"
            time.sleep(0.2)

        t1 = time.monotonic()
        with pytest.raises(WorkersLost) as lost:
            group.restart_ranks([1])
        assert 6.0 <= time.monotonic() - t1 < 15.0
        message = str(lost.value)
        assert "\n" not in message and f"role 'actor' lost node {at[1][:8]} (ranks [1])" in message
        assert (
            f"1 x {{{RESOURCE}: 1}} of pool 'trainer'" in message and "runtime.capacity_wait_s=6s" in message
        )
        assert message.endswith("resume it once the cluster has room (a job controller's retry does)")
        assert len(lines) == 1 and lines[0].startswith("waiting for capacity: role 'actor' lost node"), lines

        joined = nodes(1)
        watcher.capacity_wait_s = 60.0
        group.restart_ranks([1])  # Ray places the bundle on the node that joined; the rank starts there
        assert group.wait([group.submit(1, "node")]) == [
            next(iter(joined))
        ]  # rank 0 still sleeps: left alone
        group.shutdown()
    finally:
        remove_pools(pools)


def test_a_lost_node_with_room_left_elsewhere_is_replaced_at_once_on_the_node_that_remains(
    ray_cluster, nodes
) -> None:
    """SPREAD over two nodes with room for both bundles each: the node of rank 1 lost, Ray places its bundle on the
    other node, and the replacement starts there without waiting for capacity; a rank never starts in a bundle on
    the lost node (its raylet refuses, so the restart waits for Ray to place the bundle again)."""
    cluster = nodes(2, per_node=2.0)
    lines: list[str] = []
    watcher = NodeWatcher(capacity_wait_s=30.0, say=lines.append)
    pools = _pool("SPREAD")
    try:
        group = RayGroup(Sleeper, 2, role="actor", pool=pools["actor"], timeout_s=LIMIT_S, nodes=watcher)
        at = group.call("node")
        assert sorted(at) == sorted(cluster)
        ray_cluster.remove_node(cluster[at[1]], allow_graceful=False)
        t0 = time.monotonic()
        group.restart_ranks([1])  # at once, before Ray has declared the node dead: it waits for that first
        assert time.monotonic() - t0 < 20.0
        assert group.call("node") == [at[0], at[0]]
        assert all("waiting for capacity" in line and "lost node" in line for line in lines), lines
        group.shutdown()
    finally:
        remove_pools(pools)
