"""Rollout batches generated ahead of training (grpo.max_staleness = k), so that engines and trainer overlap.

A background thread collects batch b once the engines hold version b - k or later, while the trainer trains the
batches before it, so a sample is trained at most k versions after the weights that sampled its first token.

- Fixed schedule (the default): the trainer syncs version v + 1 into the engines only once batch v + k is
  generated, so batch b is generated under exactly max(0, b - k), engines never take new weights mid-batch, and a
  run replays exactly (its seed fixes it, not thread timing).
- Partial rollouts (`partial=True`): the trainer syncs each version at once; engines take it mid-batch and the
  sequences in flight go on under it. A batch starts under the newest weights and only once no finished batch
  waits for the trainer (generating further ahead would add staleness, not throughput), so samples reach k
  versions only when a batch runs late; what is sampled depends on timing.

After every batch the producer records `snapshot()` (the sampler's position): a checkpoint holds the batches
generated but not yet trained with the snapshot after the last of them (`checkpoint`), so a resumed run continues
from there (a batch in flight is collected again, from the same prompts). With k = 0 the batch is collected in the
caller's thread when it is taken: the synchronous loop, call for call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")
S = TypeVar("S")


def too_stale(step: int, policy_version: int, max_staleness: int) -> bool:
    """Whether a sample generated under `policy_version` is too old to train at `step`: it may be up to
    max_staleness versions behind (k kept), not one more (k + 1 dropped)."""
    return step - policy_version > max_staleness


class RolloutStream(Generic[T, S]):
    """Batches first, first + 1, ... from `produce(b)`, at most k policy versions ahead of the trainer."""

    def __init__(
        self,
        produce: Callable[[int], T],
        snapshot: Callable[[], S],
        k: int,
        first: int,
        last: int,
        buffered: list[T] | None = None,
        version: int = 0,
        partial: bool = False,
    ) -> None:
        """produce: collects batch b (on the producer thread when k >= 1); snapshot: what a checkpoint needs of the
        rollout lane after a batch; first: the next batch to train; last: one past the last batch to generate;
        buffered: batches first, first + 1, ... generated before (a resumed run's); version: the policy version the
        engines hold now; partial: syncs do not wait for the batch in flight (partial rollouts)."""
        self.produce, self.snapshot, self.k, self.last, self.partial = produce, snapshot, k, last, partial
        self._snap = snapshot()  # as of the last batch generated (or the resumed run's)
        self._ready: dict[int, T] = {first + i: b for i, b in enumerate(buffered or [])}
        self._next = first + len(self._ready)  # the next batch to generate
        self._version = version
        self._error: BaseException | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._engines = (
            threading.Lock()
        )  # held while a batch is collected: the engines and env workers are busy
        self._busy: list[tuple[float, float]] = []  # (start, end) perf_counter of each collect, for idle time
        self._collecting: float | None = None  # start of the collect in flight
        self._thread: threading.Thread | None = None
        if k > 0:
            self._thread = threading.Thread(target=self._run, name="loopline-rollouts", daemon=True)
            self._thread.start()

    # -- the trainer's side --------------------------------------------------------------------------------

    def take(self, b: int) -> tuple[T, float]:
        """Batch b and the seconds spent waiting for it."""
        start = time.perf_counter()
        if self._thread is None:  # k = 0: collected now (or generated ahead by the run this one resumed)
            return (self._ready.pop(b) if b in self._ready else self.recollect(b)), 0.0
        with self._cond:
            self._cond.wait_for(lambda: b in self._ready or self._error is not None)
            self._raise()
            batch = self._ready.pop(b)
            self._cond.notify_all()  # with partial rollouts the next batch may start now
        return batch, time.perf_counter() - start

    def recollect(self, b: int) -> T:
        """Collect batch b now, in the caller's thread (k = 0, or a batch dropped as too stale)."""
        with self._engines:
            batch = self._collect(b)
            snap = self.snapshot()
        with self._cond:
            self._snap = snap
        return batch

    def ready_to_sync(self, version: int) -> float:
        """Wait until every batch of the engines' current weights is generated (up to version - 1 + k), so that
        version can be synced; the seconds waited. No wait with partial rollouts: the engines take it mid-batch."""
        if self._thread is None or self.partial:  # k = 0: the batch was collected as it was taken
            return 0.0
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(
                lambda: self._next >= min(version - 1 + self.k + 1, self.last) or self._error is not None
            )
            self._raise()
        return time.perf_counter() - start

    def synced(self, version: int) -> None:
        """The engines hold `version` now: batches up to version + k may be generated."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def checkpoint(self) -> tuple[list[T], S]:
        """The batches generated and not yet taken, in order, and the snapshot after the last of them."""
        with self._cond:
            return [self._ready[b] for b in sorted(self._ready)], self._snap

    @contextmanager
    def engines(self) -> Iterator[None]:
        """Use the engines and env workers from the trainer's thread (eval, scaling) between two batches."""
        with self._engines:
            yield

    def close(self) -> None:
        """Stop the producer: a collect in flight finishes (its batch is dropped) before this returns, so nothing
        uses the engines after it (a restarted attempt restores their generators next)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # -- the producer's side -------------------------------------------------------------------------------

    def _collect(self, b: int) -> T:
        """produce(b), timed as engine work; the caller holds the engines lock."""
        with self._cond:
            self._collecting = start = time.perf_counter()
        try:
            return self.produce(b)
        finally:
            with self._cond:
                self._busy.append((start, time.perf_counter()))
                self._collecting = None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or (self._next < self.last and self._admitted()))
                if self._stopped:
                    return
                b = self._next
            try:
                with self._engines:
                    batch = self._collect(b)
                    snap = self.snapshot()
            except BaseException as e:  # handed to the trainer's thread, which raises it
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[b], self._snap = batch, snap
                self._next = b + 1
                self._cond.notify_all()

    def _admitted(self) -> bool:
        """Batch _next may start: the engines hold version b - k or later (fixed schedule: exactly max(0, b - k));
        with partial rollouts also no finished batch is waiting for the trainer."""
        return self._next - self.k <= self._version and not (self.partial and self._ready)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def idle_fraction(self, start: float, end: float) -> float:
        """Share of [start, end] (perf_counter) in which no batch was being collected."""
        if end <= start:
            return 0.0
        with self._cond:
            spans = [*self._busy, *([(self._collecting, end)] if self._collecting is not None else [])]
            self._busy = [(s, e) for s, e in self._busy if e > start]  # older spans are never asked for again
        busy = sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)
        return max(0.0, 1.0 - busy / (end - start))
