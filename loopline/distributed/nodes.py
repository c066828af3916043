"""Which Ray nodes are alive: a node is a failure domain (its raylet and every process on it lost at once).

`NodeWatcher` reads Ray's node table at most once a second, whenever a worker group waits on its ranks (a group's
wait is cut into slices of a second to ask) or is about to replace one: so the groups learn of a node's death as Ray
declares it, not from a call timing out. It has no thread of its own: Ray's state API is called only from the
threads that already call Ray, never beside them from a poller. Asked about one node (`gone`), it also knocks on
that node's raylet (a TCP connect): a node killed or preempted a moment ago refuses at once, seconds before the
GCS's health checks declare it dead, and until then Ray would accept an actor into a bundle there (and cancel it
later). `wait_placed` holds a replacement back until the bundles it goes into sit on live nodes: Ray re-places a
dead node's bundles where the nodes that remain have room, or on a node that joins; while neither happens it says
every SAY_EVERY_S what it waits for, and past `capacity_wait_s` (runtime.capacity_wait_s) it ends the run with
WorkersLost (the CLI: one line, exit 75). Simplified: a raylet that this process cannot reach although the GCS
keeps it alive (a firewall between driver and node) reads as lost until the GCS agrees or the wait ends.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from loopline.errors import EXIT_TEMPFAIL, WorkersLost

if TYPE_CHECKING:
    from loopline.distributed.placement import Pool

# How often a wait for capacity says what it waits for; a wait says so once as it begins, too.
SAY_EVERY_S = 30.0
# How long a knock on a raylet's port may take before the node counts as gone.
KNOCK_TIMEOUT_S = 1.0


def _answers(address: str, port: int) -> bool:
    """Whether a raylet listens at (address, port): a TCP connect, closed at once."""
    try:
        with socket.create_connection((address, port), timeout=KNOCK_TIMEOUT_S):
            return True
    except OSError:
        return False


class NodeWatcher:
    """The nodes of the connected Ray cluster, read at most every `period_s` when asked: which are alive, which died
    and when; with the rules for waiting on a lost node's bundles (`wait_placed`)."""

    def __init__(
        self,
        capacity_wait_s: float = 300.0,
        resume_hint: str = "run the same command again with --resume",
        period_s: float = 1.0,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        """capacity_wait_s: longest wait for a lost node's bundles to be placed again (runtime.capacity_wait_s);
        resume_hint: how to go on after it (the command, with its out_dir); say: where the waiting lines go."""
        self.capacity_wait_s, self.resume_hint = capacity_wait_s, resume_hint
        self.period_s, self._say = period_s, say
        self._lock = threading.Lock()  # a checkpoint finishing in the background asks too
        self._alive: dict[str, tuple[str, int]] = {}  # node id -> its raylet's (address, port)
        self._dead: dict[str, float] = {}  # node id -> when this watcher first saw it dead (time.monotonic)
        self._read_at = -float("inf")  # when the node table was last read (time.monotonic)

    def refresh(self, max_age_s: float = 0.0) -> None:
        """Read Ray's node table, unless it was read less than `max_age_s` ago."""
        import ray

        with self._lock:
            if time.monotonic() - self._read_at < max_age_s:
                return
            nodes = ray.nodes()
            now = self._read_at = time.monotonic()
            for node in nodes:
                nid = node["NodeID"]
                if node["Alive"]:
                    self._alive[nid] = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
                    self._dead.pop(nid, None)
                else:
                    self._alive.pop(nid, None)
                    self._dead.setdefault(nid, now)

    def dead(self, node: str) -> bool:
        """Whether Ray has declared `node` dead (the node table read at most `period_s` ago)."""
        self.refresh(self.period_s)
        with self._lock:
            return node in self._dead

    def gone(self, node: str) -> bool:
        """Whether `node` is lost: declared dead by Ray, or its raylet does not answer (killed a moment ago)."""
        self.refresh(self.period_s)
        with self._lock:
            where, dead = self._alive.get(node), node in self._dead
        if dead:
            return True
        if where is None:  # a node that joined since the last poll
            self.refresh()
            with self._lock:
                where = self._alive.get(node)
            if where is None:
                return True
        return not _answers(*where)

    def wait_placed(self, placement_group: Any, bundles: Sequence[int], who: str, need: str) -> list[str]:
        """The node of each of `bundles` of `placement_group`, once each sits on a live node (at once when they do).

        Ray places a dead node's bundles again where room is left, or on a node that joins; until then this says,
        as it begins and every SAY_EVERY_S, what it waits for (`who`: the role and ranks, and what they lost;
        `need`: one bundle's resources), and raises WorkersLost naming them past capacity_wait_s."""
        from ray.util import placement_group_table

        t0, said = time.monotonic(), -SAY_EVERY_S
        while True:
            table = placement_group_table(placement_group)["bundles_to_node_id"]
            nodes = [table.get(b, "") for b in bundles]
            answers = {n: not self.gone(n) for n in set(nodes) if n}
            waiting = [b for b, n in zip(bundles, nodes) if not answers.get(n, False)]
            if not waiting:
                return nodes
            waited = time.monotonic() - t0
            if waited >= self.capacity_wait_s:
                raise WorkersLost(
                    f"{who}, and no node with room for {len(waiting)} x {need} (bundles {waiting}) joined within "
                    f"runtime.capacity_wait_s={self.capacity_wait_s:g}s; exiting {EXIT_TEMPFAIL} (EX_TEMPFAIL): "
                    f"{self.resume_hint} once the cluster has room (a job controller's retry does)"
                )
            if time.monotonic() - said >= SAY_EVERY_S:
                said = time.monotonic()
                # a bundle on a node that does not answer, which Ray still calls alive: placed again once it does not
                verdict = any(n and not self.dead(n) for b, n in zip(bundles, nodes) if b in waiting)
                why = "Ray has yet to declare the lost node dead" if verdict else "no live node has room"
                self._say(
                    f"waiting for capacity: {who}; its ranks need {len(waiting)} x {need} (bundles {waiting}) on "
                    f"a live node, and {why} (waited {waited:.0f}s of runtime.capacity_wait_s="
                    f"{self.capacity_wait_s:g}s)"
                )
            time.sleep(min(self.period_s, 0.5))

    def wait_ranks(self, role: str, ranks: list[tuple[int, Pool, int, str]]) -> None:
        """wait_placed for the bundles of `ranks` of `role`, each (rank, pool, bundle index, the node it ran on),
        before they are replaced: at once where their nodes are alive; the lost nodes named in what it says."""
        gone = {node: self.gone(node) for node in {node for *_, node in ranks}}
        lost = [rank for rank, *_, node in ranks if gone[node]]
        nodes = ", ".join(sorted(node[:8] for node, g in gone.items() if g))
        who = (
            f"role '{role}' lost node {nodes} (ranks {lost})"
            if lost
            else f"role '{role}' (ranks {[r for r, *_ in ranks]})"
        )
        for pool in {id(p): p for _, p, *_ in ranks}.values():
            self.wait_placed(pool.placement_group, [b for _, p, b, _ in ranks if p is pool], who, _need(pool))

    def wait_pool(self, role: str, pool: Pool, ranks: int) -> None:
        """wait_placed for the first `ranks` bundles of `pool`, before `role`'s ranks start there (a start again
        after a node was lost while the roles started)."""
        self.wait_placed(pool.placement_group, range(ranks), f"role '{role}' is starting", _need(pool))


def _need(pool: Pool) -> str:
    """One bundle of `pool`, as the waiting lines name it."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in pool.bundle.items()) + f"}} of pool '{pool.name}'"
