"""The env pool's parts that both backends share: its config, the task and worker records, the backend
protocol and the call a worker makes (loopline/envs/pool.py runs the pool; pool_ray.py is its Ray backend)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from pydantic import Field

from loopline.section import Section

R = TypeVar("R")


class EnvPoolConfig(Section):
    """Where env tasks run and how failures are handled."""

    backend: Literal["local", "ray"] = Field("local", description="Local worker processes or Ray actors.")
    num_workers: int = Field(2, ge=0, description="Workers to keep running.")
    max_concurrency: int = Field(0, ge=0, description="Most tasks in flight at once; 0 = one per worker.")
    task_timeout_s: float = Field(120.0, gt=0, description="A task running longer kills its worker.")
    max_attempts: int = Field(3, ge=1, description="Tries per task when workers die or time out.")
    ray_address: str = Field(
        "", description="Ray cluster to join if this process has no Ray yet; empty = start a local one."
    )
    ray_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per Ray worker actor.")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per actor, e.g. {env_node: 0.1}."
    )


@dataclass(frozen=True)
class Outcome(Generic[R]):
    """The result of one sample's task: a value, or why there is none."""

    sample_id: Hashable
    value: R | None
    error: str | None  # None when `fn` returned; else its exception, or the worker failure
    attempts: int  # 1 unless workers died or timed out on this task
    worker: str  # name of the worker that produced it ("" if none did)
    failures: tuple[str, ...] = ()  # why each earlier attempt was lost, oldest first
    recovered_s: float = 0.0  # from the loss of its first attempt to this outcome (0 when none was lost)
    where: str = ""  # fn raised: where in the user's code (envs.frames.user_frames), "" when nowhere
    trace: str = ""  # fn raised: its whole traceback in the worker

    @property
    def ok(self) -> bool:
        """Whether `fn` returned a value."""
        return self.error is None


@dataclass(frozen=True)
class RayBundles:
    """Ray workers go into these bundles, the least-loaded first, asking for no resources of their own: the
    bundles already reserve the role's resources on the nodes placement chose, and any number fit in one."""

    placement_group: Any  # ray.util.placement_group.PlacementGroup
    num_bundles: int


@dataclass(frozen=True)
class WorkerInfo:
    """A live worker, as seen by the pool."""

    name: str
    pid: int | None
    busy_with: Hashable | None  # sample id of the task it is running


@dataclass
class _Task:
    sample_id: Hashable
    item: Any
    timeout_s: float  # a worker on it longer is taken for hung
    attempt: int = 1
    started: float = 0.0
    failures: tuple[str, ...] = ()
    lost_at: float = 0.0  # time.monotonic() when its first attempt was lost (0: none was)

    @property
    def token(self) -> tuple[Hashable, int]:
        return (self.sample_id, self.attempt)


@dataclass
class _Worker:
    name: str
    handle: Any  # backend-specific
    ready: bool = False  # started and able to take a task (task timeouts exclude start-up)
    task: _Task | None = None
    retiring: bool = False


# (token, ok, value, or a Failure or error text) as sent back by a worker
_Reply = tuple[tuple[Hashable, int], bool, Any]
# What poll() reports about a worker: it became ready, it answered (with the reply), or it died.
_Event = tuple[_Worker, Literal["ready", "reply", "dead"], _Reply | None]
# Consecutive workers that die before becoming ready, after which the pool gives up.
MAX_START_FAILURES = 3


class _Backend(Protocol):
    """Starts, feeds, watches and kills workers of one kind."""

    def start(self, name: str) -> _Worker: ...
    def submit(self, worker: _Worker, task: _Task) -> None: ...
    def poll(self, workers: list[_Worker], timeout: float) -> list[_Event]: ...
    def pid(self, worker: _Worker) -> int | None: ...
    def alive(self, worker: _Worker) -> bool: ...
    def kill(self, worker: _Worker) -> None: ...
    def stop(self, worker: _Worker) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Failure:
    """What a worker sends back for a task that raised: the error in one line, where in the user's code it was
    raised (envs.frames.user_frames; "" when nowhere) and the whole traceback (for --debug)."""

    error: str
    where: str = ""
    trace: str = ""


def _call(fn: Callable[[Any], Any], token: tuple[Hashable, int], item: Any) -> _Reply:
    """Run one task inside a worker; an exception becomes a Failure."""
    try:
        return (token, True, fn(item))
    except Exception as e:
        from loopline.envs.frames import full_traceback, user_frames

        return (token, False, Failure(f"{type(e).__name__}: {e}", user_frames(e), full_traceback(e)))


# ---------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------
