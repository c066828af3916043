"""The scorer role: the env (`env.name`) scores every completion and steps every multi-turn episode, on the env
workers, never in the controller.

Its work is one function, `envs.episodes.run_task` (it imports neither torch nor transformers, so an env
worker starts in about a second). `ScorerRole` runs it on an elastic pool of env workers (envs.pool.WorkerPool):
processes on the local backend, Ray actors in the env pool's bundles on ray. A worker that dies or hangs is
replaced and its chunk retried on another (bounded), and `resize` changes the workers, also mid-step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from loopline.data.rows import PromptRow
from loopline.distributed.workers import WorkerError
from loopline.envs.base import StepResult
from loopline.envs.config import EnvConfig
from loopline.envs.episodes import AgentRuns, Chunk, EnvError, Histories, chunk_time_limit, run_task
from loopline.envs.frames import WorkerTraceback

if TYPE_CHECKING:
    from loopline.distributed.placement import Pool


@dataclass(frozen=True)
class Scores:
    """The env's verdicts on a batch of single-turn completions, in order."""

    rewards: torch.Tensor  # (B,) float
    correct: torch.Tensor  # (B,) bool: counts as correct (envs.base.counts_correct): accuracy


class ScoringError(WorkerError):
    """Completions left without a score: their chunk's every try died or timed out (an env that raised or
    misbehaved is an envs.episodes.EnvError instead: the user's to fix, named in one line)."""

    def __init__(self, detail: str) -> None:
        RuntimeError.__init__(self, f"role 'env' score(): {detail}")
        self.role, self.rank, self.method = "env", -1, "score"  # a pool task has no fixed rank


class ScorerRole:
    """The env's episodes on an elastic pool of env workers: local processes (pool None) or Ray actors in `pool`'s
    bundles.

    A step's completions go out as chunks keyed by their offset, chunks_per_worker per worker. A worker that
    dies, or hangs past task_timeout_s plus what the env's own time limits allow its chunk
    (envs.episodes.chunk_time_limit), is replaced and its chunk scored again on another, at most max_attempts
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
        fn: Callable[[Any], list[Any]] | None = None,
        chunks_per_worker: int = 1,
    ) -> None:
        """env: the env section (envs.config.EnvConfig) or an env's name; fn: runs each task instead (picklable; a
        score task is a (texts, rows) chunk, answered with an envs.episodes.Verdict per text, a step task an
        envs.episodes.Histories).

        chunks_per_worker: 1 by default, as measured (512 completions, 2 workers, local Ray): one chunk per
        worker 2.5 ms, 4 per worker 9 ms, one task per completion 830 ms. A task costs a ~2 ms round trip
        and the verifier microseconds per text, so rescoring a lost worker's whole share costs next to nothing.
        """
        from loopline.envs.pool import EnvPoolConfig, RayBundles, WorkerPool

        if workers < 1 or chunks_per_worker < 1:
            raise ValueError(f"workers ({workers}) and chunks_per_worker ({chunks_per_worker}) must be >= 1")
        self.chunks_per_worker = chunks_per_worker
        self.env = EnvConfig(name=env) if isinstance(env, str) else env
        self.task_timeout_s = task_timeout_s
        self._retries = 0  # chunks scored again since take_stats()
        self._lost = 0  # pool.workers_lost at the last take_stats()
        self._recovered = 0.0  # longest time to recover a lost chunk since take_stats() (0: none was lost)
        fn = fn or functools.partial(run_task, env)
        limits = {"num_workers": workers, "task_timeout_s": task_timeout_s, "max_attempts": max_attempts}
        if pool is None:
            self.pool: WorkerPool = WorkerPool(fn, EnvPoolConfig(backend="local", **limits))
            return
        if "env" not in pool.roles:
            raise ValueError(f"the scorer runs on the env role's pool; pool '{pool.name}' holds {pool.roles}")
        bundles = RayBundles(pool.placement_group, pool.num_bundles)
        self.pool = WorkerPool(fn, EnvPoolConfig(backend="ray", **limits), bundles)

    def score(self, texts: list[str], rows: list[PromptRow]) -> Scores:
        """The reward of each single-turn completion and whether it counts as correct (envs.episodes.Verdict), in
        order."""
        if len(texts) != len(rows):
            raise ValueError(f"score(): {len(texts)} texts but {len(rows)} rows")
        verdicts = self._run(len(texts), lambda i, j: (texts[i:j], rows[i:j])) if texts else []
        rewards = torch.tensor([v.reward for v in verdicts], dtype=torch.float32)  # (B,)
        return Scores(rewards, torch.tensor([v.correct for v in verdicts], dtype=torch.bool))

    def step(self, rows: list[PromptRow], actions: list[list[str]]) -> list[StepResult]:
        """Each multi-turn episode replayed to its last action (envs.episodes.step_chunk); the results, in order."""
        if len(actions) != len(rows):
            raise ValueError(f"step(): {len(actions)} histories but {len(rows)} rows")
        return self._run(len(rows), lambda i, j: Histories(rows[i:j], actions[i:j])) if rows else []

    def run_agents(self, rows: list[PromptRow], episode_ids: list[str], base_url: str) -> list[float]:
        """env.name=openai_agent: the agent program run once per row against the endpoint at base_url
        (envs.episodes.run_agents); the reward of each run, in order."""
        if len(episode_ids) != len(rows):
            raise ValueError(f"run_agents(): {len(episode_ids)} episode ids but {len(rows)} rows")
        return (
            self._run(len(rows), lambda i, j: AgentRuns(rows[i:j], episode_ids[i:j], base_url))
            if rows
            else []
        )

    def _run(self, n: int, chunk: Callable[[int, int], Chunk | Histories | AgentRuns]) -> list[Any]:
        """n items as chunks of the pool's tasks; the results in order, or the first chunk's failure raised."""
        size = max(1, math.ceil(n / (self.pool.num_workers * self.chunks_per_worker)))
        starts = range(0, n, size)
        chunks: dict[Hashable, Any] = {i: chunk(i, min(i + size, n)) for i in starts}
        timeouts: dict[Hashable, float] = {
            i: self.task_timeout_s + chunk_time_limit(self.env, min(i + size, n) - i) for i in starts
        }
        # one outcome per chunk (keyed by its offset), whatever happened to the workers
        outcomes = cast("dict[int, Any]", self.pool.map(chunks, timeouts))
        self._retries += sum(o.attempts - 1 for o in outcomes.values())
        recovered = max((o.recovered_s for o in outcomes.values() if o.ok), default=0.0)
        if recovered:
            print(
                f"recovered in {recovered:.1f}s from a failure of role 'env' (its chunk done by another worker)"
            )
            self._recovered = max(self._recovered, recovered)
        failed = sorted(i for i, o in outcomes.items() if not o.ok)
        if failed:
            more = f" (and {len(failed) - 1} more chunks)" if len(failed) > 1 else ""
            first = outcomes[failed[0]]
            last = min(failed[0] + size, n) - 1
            if first.worker:  # a worker ran the chunk and the env raised or misbehaved: the env's to fix
                where = f"\n{first.where}" if first.where else ""  # the user's frames (envs.frames)
                raise EnvError(
                    f"completions {failed[0]}..{last}{more} got no score: {first.error}{where}"
                ) from WorkerTraceback(first.trace)
            raise ScoringError(f"completions {failed[0]}..{last}{more} got no score: {first.error}")
        return [value for i in sorted(outcomes) for value in outcomes[i].value]

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
        if self._recovered:
            stats["recover_env_s"] = self._recovered
        self._retries, self._lost, self._recovered = 0, lost, 0.0
        return stats

    def close(self) -> None:
        """Stop the workers."""
        self.pool.close()
