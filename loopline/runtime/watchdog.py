"""A watchdog for the controller loop: a stage that runs too long fails the run, saying where it hung.

The loop wraps each stage (`with watchdog.stage("rollout"): ...`). A daemon thread checks the stages
in flight; when one has run longer than runtime.stage_timeout_s it prints which stage of which role and
rank is stuck and for how long, dumps every thread's stack, and ends the process with exit status 3:
a hung collective or a wedged worker becomes an error within a bounded time, not a silent hang. The
process ends from the watchdog thread (os._exit) because the stuck thread cannot be interrupted; the
newest whole checkpoint stays as it was, so `--resume` continues from it.

On the ray backend every call on a worker group also has its own limit (runtime.call_timeout_s) and
names the exact rank that did not answer; the watchdog covers what that does not: the local backend,
where calls run in this thread, and the driver's own work between calls.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from loopline.checkpoint.faults import FAULTS

EXIT_STUCK = 3  # the exit status of a run the watchdog ended

# The role that does a stage's work (what a stuck stage is waiting on).
STAGE_ROLES = {
    "rollout": "rollout",
    "score": "env",
    "experience": "actor",
    "train": "actor",
    "sync": "actor+rollout",
    "eval": "rollout",
    "checkpoint": "actor",
}


@dataclass
class _Running:
    stage: str
    role: str
    ranks: str
    started: float


class Watchdog:
    """Ends the process (status 3) when a watched stage runs longer than timeout_s; 0 = off."""

    def __init__(self, timeout_s: float, ranks: dict[str, int] | None = None) -> None:
        """ranks: ranks per role (e.g. {"actor": 2}), to name them in the report; 1 each if not given."""
        self.timeout_s = timeout_s
        self.ranks = ranks or {}
        self._running: list[_Running] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="loopline-watchdog", daemon=True)
            self._thread.start()

    @contextmanager
    def stage(self, name: str, role: str | None = None) -> Iterator[None]:
        """Watch the body as stage `name` of `role` (by default the role that does that stage's work)."""
        role = role or STAGE_ROLES.get(name, "driver")
        running = _Running(name, role, self._rank_names(role), time.monotonic())
        with self._lock:
            self._running.append(running)
        try:
            FAULTS.pause_point(f"stage:{name}")  # test hook: a stage that hangs
            yield
        finally:
            with self._lock:
                self._running.remove(running)

    def _rank_names(self, role: str) -> str:
        n = max((self.ranks.get(r, 1) for r in role.split("+")), default=1)
        return "rank 0" if n == 1 else f"ranks 0-{n - 1}"

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            now = time.monotonic()
            with self._lock:
                late = [r for r in self._running if now - r.started > self.timeout_s]
            if late:
                self._fire(late[-1], now - late[-1].started)

    def _fire(self, stuck: _Running, elapsed: float) -> None:
        sys.stderr.write(
            f"\nloopline: watchdog: stage '{stuck.stage}' of role '{stuck.role}' ({stuck.ranks}) is stuck: "
            f"running for {elapsed:.1f}s, over runtime.stage_timeout_s={self.timeout_s:g}. "
            f"Stacks of this process's threads follow; exiting with status {EXIT_STUCK}.\n"
        )
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_STUCK)

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
