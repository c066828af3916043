"""Pooled execution of env tasks (e.g. sandboxed code checks) on CPU workers.

`WorkerPool(fn, config)` runs `fn(item)` for every item of a batch on long-lived workers: local
processes (backend "local") or Ray actors (backend "ray", for env workers on other nodes).

Guarantees, whatever happens to the workers:
- every sample id of a batch gets exactly one `Outcome`; nothing is lost or counted twice;
- a worker that dies or exceeds `task_timeout_s` (or the task's own time limit, given with the batch) is killed
  and replaced, and its task is retried on another worker, at most `max_attempts` times in all, after which the
  outcome is an error;
- an exception raised by `fn` is an outcome too (not retried: it would fail again);
- workers may be added or removed (`add_workers`, `remove_workers`) from any thread while a batch
  runs; a removed busy worker finishes its task first.

On Ray, `RayBundles` pins the workers to the bundles of a placement group (a role's pool), spread evenly
over them, any number per bundle; without it each worker asks for `ray_num_cpus` and `ray_resources`.

Each task carries a token (sample id, attempt); a reply whose token is not the one its worker is
working on (e.g. from a batch abandoned half-way) is dropped, which is what makes delivery exact.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, TypeVar

from loopline.envs import pool_worker
from loopline.envs.pool_parts import (
    MAX_START_FAILURES,
    EnvPoolConfig,
    Failure,
    Outcome,
    RayBundles,
    WorkerInfo,
    _Backend,
    _Event,
    _Task,
    _Worker,
)
from loopline.errors import UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class WorkerPool(Generic[T, R]):
    """Runs `fn` over batches of {sample id: item} on a resizable set of workers."""

    def __init__(
        self, fn: Callable[[T], R], config: EnvPoolConfig | None = None, bundles: RayBundles | None = None
    ) -> None:
        """bundles: where Ray workers go (backend "ray" only); None = anywhere with ray_num_cpus free."""
        self.config = config or EnvPoolConfig()
        if bundles is not None and self.config.backend != "ray":
            raise ValueError("bundles place Ray workers; they need backend 'ray'")
        self._backend: _Backend = (
            _LocalBackend(fn) if self.config.backend == "local" else ray_backend(fn, self.config, bundles)
        )
        self._lock = threading.RLock()
        self._workers: list[_Worker] = []
        self._target = self.config.num_workers
        self._names = itertools.count()
        self._running = False
        self._closed = False
        self._start_failures = 0
        self._lost = 0
        with self._lock:
            self._apply_membership()

    # -- membership ------------------------------------------------------------------------

    def add_workers(self, n: int = 1) -> None:
        """Run `n` more workers (started at once, or by the running batch within ~50 ms)."""
        with self._lock:
            self._target += n
            if not self._running:
                self._apply_membership()

    def remove_workers(self, n: int = 1) -> None:
        """Run `n` fewer workers; idle ones stop first, busy ones after their task."""
        with self._lock:
            self._target = max(0, self._target - n)
            if not self._running:
                self._apply_membership()

    def workers(self) -> list[WorkerInfo]:
        """The live workers (including ones finishing a task before retiring)."""
        with self._lock:
            return [
                WorkerInfo(w.name, self._backend.pid(w), w.task.sample_id if w.task else None)
                for w in self._workers
            ]

    @property
    def num_workers(self) -> int:
        """How many workers the pool is keeping (the target, not counting retiring ones)."""
        return self._target

    @property
    def workers_lost(self) -> int:
        """Workers that died or timed out since the pool started (each was replaced)."""
        return self._lost

    def _apply_membership(self) -> None:
        """Start or retire workers to reach the target. Caller holds the lock."""
        active = [w for w in self._workers if not w.retiring]
        while len(active) < self._target:
            worker = self._backend.start(f"{self.config.backend}-{next(self._names)}")
            self._workers.append(worker)
            active.append(worker)
        surplus = len(active) - self._target
        for worker in sorted(active, key=lambda w: w.task is not None)[: max(0, surplus)]:
            worker.retiring = True
        for worker in [w for w in self._workers if w.retiring and w.task is None]:
            self._workers.remove(worker)
            self._backend.stop(worker)

    def _drop(self, worker: _Worker, kill: bool) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
        if kill:
            self._backend.kill(worker)

    # -- batches ---------------------------------------------------------------------------

    def map(
        self, items: Mapping[Hashable, T], timeouts: Mapping[Hashable, float] | None = None
    ) -> dict[Hashable, Outcome[R]]:
        """Run a whole batch; returns one outcome per sample id."""
        return {o.sample_id: o for o in self.imap(items, timeouts)}

    def imap(
        self, items: Mapping[Hashable, T], timeouts: Mapping[Hashable, float] | None = None
    ) -> Iterator[Outcome[R]]:
        """Run a batch, yielding each sample's outcome as soon as it is final (any order). timeouts: seconds a
        worker may spend on a sample's task before it counts as hung, by sample id (default: task_timeout_s)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is closed")
            if self._running:
                raise RuntimeError("a batch is already running on this pool")
            self._running = True
        limit = self.config.task_timeout_s
        queue = deque(
            _Task(sample_id, item, (timeouts or {}).get(sample_id, limit))
            for sample_id, item in items.items()
        )
        remaining = len(queue)
        done: set[Hashable] = set()
        try:
            while remaining:
                with self._lock:
                    self._apply_membership()
                    self._dispatch(queue)
                    snapshot = list(self._workers)
                events = self._backend.poll(snapshot, timeout=0.05)
                with self._lock:
                    finished = self._handle(events, queue) + self._expire(queue)
                for outcome in finished:
                    assert outcome.sample_id not in done, f"second outcome for {outcome.sample_id!r}"
                    done.add(outcome.sample_id)
                    remaining -= 1
                    yield outcome
        finally:
            with self._lock:
                # A batch abandoned half-way: its in-flight tasks would answer late; replace those
                # workers so the next batch starts clean.
                for worker in [w for w in self._workers if w.task is not None]:
                    self._drop(worker, kill=True)
                self._running = False
                if not self._closed:
                    self._apply_membership()

    def _dispatch(self, queue: deque[_Task]) -> None:
        # Workers that died while idle (e.g. between batches) must not be handed a task.
        for worker in [w for w in self._workers if w.task is None and not self._backend.alive(w)]:
            self._died(worker)
        self._apply_membership()
        limit = self.config.max_concurrency or len(self._workers)
        in_flight = sum(w.task is not None for w in self._workers)
        for worker in self._workers:
            if not queue or in_flight >= limit:
                return
            if worker.ready and worker.task is None and not worker.retiring:
                task = queue.popleft()
                task.started = time.monotonic()
                worker.task = task
                self._backend.submit(worker, task)
                in_flight += 1

    def _handle(self, events: list[_Event], queue: deque[_Task]) -> list[Outcome[R]]:
        finished: list[Outcome[R]] = []
        for worker, kind, reply in events:
            task = worker.task
            if kind == "ready":
                worker.ready = True
                self._start_failures = 0
            elif kind == "dead":
                self._died(worker)
                if task is not None:
                    finished += self._retry(task, queue, f"worker {self._describe(worker)} died")
            elif reply is not None and task is not None and reply[0] == task.token:
                token, ok, value = reply
                worker.task = None
                failure = None if ok else value if isinstance(value, Failure) else Failure(str(value))
                recovered = time.monotonic() - task.lost_at if task.lost_at else 0.0
                finished.append(
                    Outcome(
                        task.sample_id,
                        value if ok else None,
                        None if failure is None else failure.error,
                        task.attempt,
                        worker.name,
                        task.failures,
                        recovered,
                        "" if failure is None else failure.where,
                        "" if failure is None else failure.trace,
                    )
                )
            # else: a stale reply, for a task already given up on
        return finished

    def _died(self, worker: _Worker) -> None:
        task = worker.task
        logger.warning(
            "env worker %s died%s",
            self._describe(worker),
            f" running {task.sample_id!r}" if task else (" while idle" if worker.ready else " starting up"),
        )
        self._drop(worker, kill=True)
        self._lost += 1
        if not worker.ready:
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                raise RuntimeError(
                    f"{self._start_failures} env workers in a row died while starting; see their stderr"
                )

    def _expire(self, queue: deque[_Task]) -> list[Outcome[R]]:
        finished: list[Outcome[R]] = []
        now = time.monotonic()
        for worker in list(self._workers):
            task = worker.task
            if task is not None and now - task.started > task.timeout_s:
                logger.warning("env task %r timed out on %s; killing the worker", task.sample_id, worker.name)
                self._drop(worker, kill=True)
                self._lost += 1
                why = f"timed out after {task.timeout_s:g}s on {self._describe(worker)}"
                finished += self._retry(task, queue, why)
        return finished

    def _retry(self, task: _Task, queue: deque[_Task], why: str) -> list[Outcome[R]]:
        failures = (*task.failures, why)
        if task.attempt >= self.config.max_attempts:
            error = f"{why}; gave up after {task.attempt} attempts"
            return [Outcome(task.sample_id, None, error, task.attempt, "", failures)]
        lost_at = task.lost_at or time.monotonic()
        queue.appendleft(
            replace(task, attempt=task.attempt + 1, started=0.0, failures=failures, lost_at=lost_at)
        )
        return []

    def _describe(self, worker: _Worker) -> str:
        return f"{worker.name} (pid {self._backend.pid(worker)})"

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker (and Ray, if this pool started it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in list(self._workers):
                self._drop(worker, kill=False)
                self._backend.stop(worker)
            self._backend.close()

    def __enter__(self) -> WorkerPool[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Local worker processes
# ---------------------------------------------------------------------------------------------


def _send_quietly(conn: Connection, data: bytes) -> None:
    """Send `data`; a worker that died at once (or was stopped) is seen by poll(), not here."""
    with contextlib.suppress(OSError, ValueError):
        conn.send_bytes(data)


@dataclass
class _LocalHandle:
    process: subprocess.Popen
    conn: Connection
    sentinel: int | None  # a pidfd, readable once the process has ended (None where the OS has none)


class _LocalBackend:
    """Workers are fresh interpreters running loopline.envs.pool_worker (not the user's `__main__`; not fork: the
    host may run threads), fed `fn` by value over a socket."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        try:
            self.payload = pool_worker.payload(fn)
        except Exception as e:
            raise UserError(
                f"the env workers' task {fn!r} cannot be pickled to send to them: {type(e).__name__}: {e}"
            ) from e

    def start(self, name: str) -> _Worker:
        ours, theirs = socket.socketpair()
        # the child starts with SIGINT blocked (a signal mask survives fork and exec) until its main ignores it: a
        # Ctrl-C while it imports is no KeyboardInterrupt traceback either. Only this thread's mask, for a moment.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process = subprocess.Popen(pool_worker.command(theirs.fileno()), pass_fds=(theirs.fileno(),))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
        conn = Connection(ours.detach())
        # from a thread: a payload larger than the socket's buffer waits for the worker to start reading it
        threading.Thread(target=_send_quietly, args=(conn, self.payload), daemon=True).start()
        sentinel = None
        with contextlib.suppress(AttributeError, OSError):  # os.pidfd_open: Linux 5.3, Python 3.9
            sentinel = os.pidfd_open(process.pid)
        return _Worker(name, _LocalHandle(process, conn, sentinel))

    def submit(self, worker: _Worker, task: _Task) -> None:
        # A dead worker cannot take the task; poll() sees its end and the task is retried.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            worker.handle.conn.send((task.token, task.item))

    def poll(self, workers: list[_Worker], timeout: float) -> list[_Event]:
        by_object: dict[Any, _Worker] = {}
        for w in workers:
            by_object[w.handle.conn] = w
            if w.handle.sentinel is not None:
                by_object[w.handle.sentinel] = w
        events: dict[str, _Event] = {}
        for ready in wait(list(by_object), timeout):
            worker = by_object[ready]
            if worker.name in events:
                continue
            conn = worker.handle.conn
            try:
                # A worker may answer and then die: read the answer before declaring it dead.
                message = conn.recv() if conn.poll() else None
            except (EOFError, OSError):
                message = None
            if message is None:
                events[worker.name] = (worker, "dead", None)
            elif message == pool_worker.READY:
                events[worker.name] = (worker, "ready", None)
            else:
                events[worker.name] = (worker, "reply", message)
        return list(events.values())

    def pid(self, worker: _Worker) -> int | None:
        return worker.handle.process.pid

    def alive(self, worker: _Worker) -> bool:
        return worker.handle.process.poll() is None

    def kill(self, worker: _Worker) -> None:
        worker.handle.process.kill()
        worker.handle.process.wait()
        self._close(worker)

    def stop(self, worker: _Worker) -> None:
        with contextlib.suppress(OSError):
            worker.handle.conn.send(None)
        try:
            worker.handle.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.handle.process.kill()
            worker.handle.process.wait()
        self._close(worker)

    def _close(self, worker: _Worker) -> None:
        worker.handle.conn.close()
        if worker.handle.sentinel is not None:
            os.close(worker.handle.sentinel)
            worker.handle.sentinel = None

    def close(self) -> None:
        pass


def ray_backend(fn: Callable[[Any], Any], config: EnvPoolConfig, bundles: RayBundles | None) -> _Backend:
    """The Ray backend (loopline/envs/pool_ray.py), imported only when a pool asks for it."""
    from loopline.envs.pool_ray import RayBackend

    return RayBackend(fn, config, bundles)
