"""The scorer role: the env (`env.name`) scores every completion, on the env workers, never in the controller.

Its work is one function, `envs.single_turn.score_chunk` (it imports neither torch nor transformers, so an env
worker starts in about a second). `ScorerRole` runs it on an elastic pool of env workers (envs.pool.WorkerPool):
processes on the local backend, Ray actors in the env pool's bundles on ray. A worker that dies or hangs is
replaced and its chunk retried on another (bounded), and `resize` changes the workers, also mid-step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, cast

import torch

from loopline.data.rows import PromptRow
from loopline.envs.config import EnvConfig
from loopline.envs.single_turn import Chunk, EnvError, score_chunk
from loopline.runtime.workers import WorkerError

if TYPE_CHECKING:
    from loopline.runtime.placement import Pool


class ScoringError(WorkerError):
    """Completions left without a score: their chunk's every try died or timed out (an env that raised or
    misbehaved is an envs.single_turn.EnvError instead: the user's to fix, named in one line)."""

    def __init__(self, detail: str) -> None:
        RuntimeError.__init__(self, f"role 'env' score(): {detail}")
        self.role, self.rank, self.method = "env", -1, "score"  # a pool task has no fixed rank


class ScorerRole:
    """The env's episodes on an elastic pool of env workers: local processes (pool None) or Ray actors in `pool`'s
    bundles.

    A step's completions go out as chunks keyed by their offset, chunks_per_worker per worker. A worker that
    dies, or hangs past task_timeout_s, is replaced and its chunk scored again on another, at most max_attempts
    tries in all; every completion gets exactly one score, in order. Workers beyond the pool's bundles share them
    (the bundles reserve the env role's resources on the nodes placement chose).
    """

    def __init__(
        self,
        env: EnvConfig | str = "addition",
        pool: Pool | None = None,
        workers: int = 1,
        task_timeout_s: float = 60.0,
        max_attempts: int = 3,
        fn: Callable[[Chunk], list[float]] | None = None,
        chunks_per_worker: int = 1,
    ) -> None:
        """env: the env section (envs.config.EnvConfig) or an env's name; fn: scores one (texts, rows) chunk instead
        (picklable).

        chunks_per_worker: 1 by default, as measured (512 completions, 2 workers, local Ray): one chunk per
        worker 2.5 ms, 4 per worker 9 ms, one task per completion 830 ms. A task costs a ~2 ms round trip
        and the verifier microseconds per text, so rescoring a lost worker's whole share costs next to nothing.
        """
        from loopline.envs.pool import EnvPoolConfig, RayBundles, WorkerPool

        if workers < 1 or chunks_per_worker < 1:
            raise ValueError(f"workers ({workers}) and chunks_per_worker ({chunks_per_worker}) must be >= 1")
        self.chunks_per_worker = chunks_per_worker
        self._retries = 0  # chunks scored again since take_stats()
        self._lost = 0  # pool.workers_lost at the last take_stats()
        fn = fn or functools.partial(score_chunk, env)
        limits = {"num_workers": workers, "task_timeout_s": task_timeout_s, "max_attempts": max_attempts}
        if pool is None:
            self.pool: WorkerPool = WorkerPool(fn, EnvPoolConfig(backend="local", **limits))
            return
        if "env" not in pool.roles:
            raise ValueError(f"the scorer runs on the env role's pool; pool '{pool.name}' holds {pool.roles}")
        bundles = RayBundles(pool.placement_group, pool.num_bundles)
        self.pool = WorkerPool(fn, EnvPoolConfig(backend="ray", **limits), bundles)

    def score(self, texts: list[str], rows: list[PromptRow]) -> torch.Tensor:
        if len(texts) != len(rows):
            raise ValueError(f"score(): {len(texts)} texts but {len(rows)} rows")
        if not texts:
            return torch.zeros(0)
        size = max(1, math.ceil(len(texts) / (self.pool.num_workers * self.chunks_per_worker)))
        chunks: dict[Hashable, Any] = {
            i: (texts[i : i + size], rows[i : i + size]) for i in range(0, len(texts), size)
        }
        # one outcome per chunk (keyed by its offset), whatever happened to the workers
        outcomes = cast("dict[int, Any]", self.pool.map(chunks))
        self._retries += sum(o.attempts - 1 for o in outcomes.values())
        failed = sorted(i for i, o in outcomes.items() if not o.ok)
        if failed:
            more = f" (and {len(failed) - 1} more chunks)" if len(failed) > 1 else ""
            first = outcomes[failed[0]]
            last = min(failed[0] + size, len(texts)) - 1
            if first.worker:  # a worker ran the chunk and the env raised or misbehaved: the env's to fix
                raise EnvError(f"completions {failed[0]}..{last}{more} got no score: {first.error}")
            raise ScoringError(f"completions {failed[0]}..{last}{more} got no score: {first.error}")
        return torch.tensor([s for i in sorted(outcomes) for s in outcomes[i].value])  # (B,)

    def resize(self, workers: int) -> None:
        """Keep `workers` env workers: new ones join the running step; removed busy ones finish their chunk."""
        if workers < 1:
            raise ValueError(f"env workers must be >= 1, got {workers}")
        change = workers - self.pool.num_workers
        if change > 0:
            self.pool.add_workers(change)
        elif change < 0:
            self.pool.remove_workers(-change)

    def take_stats(self) -> dict[str, float]:
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
        self.pool.close()
