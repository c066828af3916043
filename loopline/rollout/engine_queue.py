"""The OpenAI server's engine thread: one thread owns the engine and generates, in one call, every pending
request that samples with the same settings (waiting `batch_wait_s` for more to arrive). Requests come in as
futures, so the server's event loop never waits on the engine."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from loopline.rollout.engine import Completion, SamplingParams, TorchEngine

logger = logging.getLogger(__name__)


class ServerClosed(RuntimeError):
    """The server is shutting down: the request is answered 503."""


@dataclass
class Pending:
    """A request waiting for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    future: Future[list[Completion]]


class EngineQueue:
    """Batches the requests of many handlers into engine calls on a thread of its own."""

    def __init__(self, engine: TorchEngine, max_batch: int, batch_wait_s: float) -> None:
        self.engine, self.max_batch, self.batch_wait_s = engine, max_batch, batch_wait_s
        self._lock = threading.Lock()  # generate and update_weights never overlap
        self._queue: queue.Queue[Pending] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._generate_loop, name="openai-engine", daemon=True)
        self.batch_sizes: list[int] = []  # sequences per engine call, for metrics and tests

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; the requests still queued fail with ServerClosed."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        self._fail_queued()

    def submit(self, prompt: list[int], params: SamplingParams, n: int) -> Future[list[Completion]]:
        """A future of `n` completions of `prompt`, generated with whatever else samples like it."""
        if self._stop.is_set():
            raise ServerClosed("the server is shutting down")
        pending = Pending(prompt, params, n, Future())
        self._queue.put(pending)
        return pending.future

    def queued(self) -> int:
        """Requests waiting for the engine thread to take them."""
        return self._queue.qsize()

    @property
    def closing(self) -> bool:
        """Whether close() has begun (new requests are refused)."""
        return self._stop.is_set()

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights for the engine, between two generate calls."""
        with self._lock:
            self.engine.update_weights(state_dict, version)

    def _generate_loop(self) -> None:
        held: list[Pending] = []  # requests that did not fit the last batch
        while not self._stop.is_set():
            if not held:
                try:
                    held.append(self._queue.get(timeout=0.1))
                except queue.Empty:
                    continue
            deadline = time.monotonic() + self.batch_wait_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    held.append(self._queue.get(timeout=left))
                except queue.Empty:
                    break
            while True:  # drain whatever else arrived
                try:
                    held.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            batch, held = self._take_batch(held)
            self._run(batch)
        for p in held:
            self._queue.put(p)  # answered by _fail_queued

    def _fail_queued(self) -> None:
        while True:
            try:
                p = self._queue.get_nowait()
            except queue.Empty:
                return
            if p.future.set_running_or_notify_cancel():
                p.future.set_exception(ServerClosed("the server is shutting down"))

    def _take_batch(self, held: list[Pending]) -> tuple[list[Pending], list[Pending]]:
        """The oldest request and every later one with the same sampling settings, up to max_batch."""
        live = [p for p in held if not p.future.cancelled()]
        if not live:
            return [], []
        key = live[0].params
        batch: list[Pending] = []
        rest: list[Pending] = []
        size = 0
        for p in live:
            if p.params == key and (not batch or size + p.n <= self.max_batch):
                batch.append(p)
                size += p.n
            else:
                rest.append(p)
        # claimed: from here a timed-out request can no longer cancel its future (False: it just did)
        return [p for p in batch if p.future.set_running_or_notify_cancel()], rest

    def _run(self, batch: list[Pending]) -> None:
        if not batch:
            return
        prompts = [p.prompt_ids for p in batch for _ in range(p.n)]
        try:
            with self._lock:
                completions = self.engine.generate(prompts, batch[0].params, n=1)
        except Exception as e:  # a failed generate fails its requests, not the server
            logger.exception("generate failed")
            for p in batch:
                p.future.set_exception(e)
            return
        self.batch_sizes.append(len(prompts))
        start = 0
        for p in batch:
            p.future.set_result(completions[start : start + p.n])
            start += p.n
