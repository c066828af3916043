"""The scorer role: the task verifier, one reward per completion.

Its work is one function, `scoring.score_chunk` (kept apart so that an env worker imports neither torch nor
transformers). `ScorerRole` runs it in this process (the local backend), or on an elastic pool of CPU env
worker actors (envs.pool.WorkerPool) in the env pool's bundles (ray): a worker that dies or hangs is replaced
and its chunk retried on another (bounded), and `resize` changes the workers, also mid-step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, cast

import torch

from loopline.runtime.scoring import score_chunk
from loopline.runtime.workers import WorkerError

if TYPE_CHECKING:
    from loopline.runtime.placement import Pool


class ScoringError(WorkerError):
    """Completions left without a score: their chunk's every try died or timed out, or the verifier raised."""

    def __init__(self, detail: str) -> None:
        RuntimeError.__init__(self, f"role 'env' score(): {detail}")
        self.role, self.rank, self.method = "env", -1, "score"  # a pool task has no fixed rank


class ScorerRole:
    """The verifier, in this process (pool None) or on an elastic pool of env worker actors in `pool`'s bundles.

    On the pool a step's completions go out as chunks keyed by their offset, chunks_per_worker per worker. A
    worker that dies, or hangs past task_timeout_s, is replaced and its chunk scored again on another, at
    most max_attempts tries in all; every completion gets exactly one score, in order. Workers beyond the
    pool's bundles share them (the bundles reserve the env role's resources on the nodes placement chose).
    """

    def __init__(
        self,
        pool: Pool | None = None,
        workers: int = 1,
        task_timeout_s: float = 60.0,
        max_attempts: int = 3,
        fn: Callable[[tuple[list[str], list[str]]], list[float]] = score_chunk,
        chunks_per_worker: int = 1,
    ) -> None:
        """fn: scores one (texts, answers) chunk (picklable; the verifier by default).

        chunks_per_worker: 1 by default, as measured (512 completions, 2 workers, local Ray): one chunk per
        worker 2.5 ms, 4 per worker 9 ms, one task per completion 830 ms. A task costs a ~2 ms round trip
        and the verifier microseconds per text, so rescoring a lost worker's whole share costs next to nothing.
        """
        from loopline.envs.pool import EnvPoolConfig, RayBundles, WorkerPool

        if workers < 1 or chunks_per_worker < 1:
            raise ValueError(f"workers ({workers}) and chunks_per_worker ({chunks_per_worker}) must be >= 1")
        self.fn, self.chunks_per_worker = fn, chunks_per_worker
        self.pool: WorkerPool | None = None  # None: score in this process
        self._retries = 0  # chunks scored again since take_stats()
        self._lost = 0  # pool.workers_lost at the last take_stats()
        if pool is None:
            return
        if "env" not in pool.roles:
            raise ValueError(f"the scorer runs on the env role's pool; pool '{pool.name}' holds {pool.roles}")
        config = EnvPoolConfig(
            backend="ray", num_workers=workers, task_timeout_s=task_timeout_s, max_attempts=max_attempts
        )
        self.pool = WorkerPool(fn, config, RayBundles(pool.placement_group, pool.num_bundles))

    def score(self, texts: list[str], answers: list[str]) -> torch.Tensor:
        if len(texts) != len(answers):
            raise ValueError(f"score(): {len(texts)} texts but {len(answers)} answers")
        if self.pool is None:
            return torch.tensor(self.fn((texts, answers)))  # (B,)
        size = max(1, math.ceil(len(texts) / (self.pool.num_workers * self.chunks_per_worker)))
        chunks: dict[Hashable, Any] = {
            i: (texts[i : i + size], answers[i : i + size]) for i in range(0, len(texts), size)
        }
        # one outcome per chunk (keyed by its offset), whatever happened to the workers
        outcomes = cast("dict[int, Any]", self.pool.map(chunks))
        self._retries += sum(o.attempts - 1 for o in outcomes.values())
        failed = sorted(i for i, o in outcomes.items() if not o.ok)
        if failed:
            more = f" (and {len(failed) - 1} more chunks)" if len(failed) > 1 else ""
            error = outcomes[failed[0]].error
            last = min(failed[0] + size, len(texts)) - 1
            raise ScoringError(f"completions {failed[0]}..{last}{more} got no score: {error}")
        return torch.tensor([s for i in sorted(outcomes) for s in outcomes[i].value])  # (B,)

    def resize(self, workers: int) -> None:
        """Keep `workers` env workers: new ones join the running step; removed busy ones finish their chunk."""
        if self.pool is None:
            raise ValueError(
                "the local backend scores in this process and has no env workers to resize; use runtime.backend=ray"
            )
        if workers < 1:
            raise ValueError(f"env workers must be >= 1, got {workers}")
        change = workers - self.pool.num_workers
        if change > 0:
            self.pool.add_workers(change)
        elif change < 0:
            self.pool.remove_workers(-change)

    def take_stats(self) -> dict[str, float]:
        if self.pool is None:
            return {}  # nothing retried, no workers to count
        lost = self.pool.workers_lost
        stats = {
            "score_retries": float(self._retries),
            "env_workers_replaced": float(lost - self._lost),
            "env_workers": float(self.pool.num_workers),
        }
        self._retries, self._lost = 0, lost
        return stats

    def close(self) -> None:
        """Stop the workers."""
        if self.pool is not None:
            self.pool.close()
