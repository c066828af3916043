"""Recovery from lost workers, owned in one place: which failure is recovered how, and how many times a run may.

A run makes one `Recovery` (from runtime config) and hands it to its roles; each way back asks it first:
- start again: a rank lost while the roles start costs a start of the worker groups again (`start`);
- restart a role: a failed call on a worker group replaces that role's ranks, or every role
  (runtime.restart_scope), and the last checkpoint is loaded (`restart`, then `scope`);
- heal a rank: with runtime.trainer_replicas > 1, a lost trainer rank is rebuilt from a live replica, no
  checkpoint loaded (`may_heal`, then `healed`; the mechanism is runtime.actor.ActorRole's);
- retry a chunk: a dead engine is replaced in its bundle and its prompts issued again (`replace_engine`; the
  mechanism is runtime.engine.RolloutRole's). An env task's retries belong to its pool (envs.pool: per task).
Each of the four has an allowance for the whole run, kept across its restarts (runtime.max_restarts for the
first three, each counted apart; runtime.max_engine_replacements); past it a lost process ends the run with
WorkersLost (the CLI exits EX_TEMPFAIL, for a job controller to retry) and any other failure is raised as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypeVar

from loopline.distributed.workers import WorkerDiedError, WorkerError
from loopline.errors import EXIT_TEMPFAIL, WorkersLost
from loopline.runtime.config import RuntimeConfig

T = TypeVar("T")


class Allowance:
    """How many recoveries of one kind a run may make (`field`: the setting that says), and how many it made."""

    def __init__(self, field: str, limit: int) -> None:
        self.field, self.limit, self.used = field, limit, 0

    @property
    def left(self) -> int:
        return self.limit - self.used

    def take(self) -> int:
        """One more (its number, from 1); ValueError when none is left."""
        if self.used >= self.limit:
            raise ValueError(f"all {self.field}={self.limit} are used up")
        self.used += 1
        return self.used


def first_line(failure: BaseException) -> str:
    """Ray's account of a death runs to many lines; its first says which rank and call."""
    return str(failure).splitlines()[0]


class Recovery:
    """A run's allowances (runtime.max_restarts, max_engine_replacements) and the rule for each way back."""

    def __init__(
        self, runtime: RuntimeConfig, resume_hint: str = "run the same command again with --resume"
    ) -> None:
        """resume_hint: how to go on when the allowance is used up (the command, with its out_dir)."""
        self.scope_setting = runtime.restart_scope
        self.startups = Allowance("runtime.max_restarts", runtime.max_restarts)
        self.restarts = Allowance("runtime.max_restarts", runtime.max_restarts)
        self.heals = Allowance("runtime.max_restarts", runtime.max_restarts)
        self.engines = Allowance("runtime.max_engine_replacements", runtime.max_engine_replacements)
        self.resume_hint = resume_hint

    def start(self, start: Callable[[], T], stop: Callable[[], None]) -> T:
        """`start()` (the worker groups, their worlds), again after `stop()` when a rank is lost meanwhile. A rank
        that raised is not retried (its constructor would raise again), nor one past its call timeout (slow, not
        lost: a start again would be slower still)."""
        while True:
            try:
                return start()
            except WorkerDiedError as e:
                stop()
                if not self.startups.left:
                    raise WorkersLost(
                        f"{first_line(e)}: a worker was lost while the roles started, and runtime.max_restarts="
                        f"{self.startups.limit} allows no more restarts; exiting {EXIT_TEMPFAIL} (EX_TEMPFAIL): "
                        f"{self.resume_hint} (a job controller's retry does)"
                    ) from e
                print(
                    f"{first_line(e)}: lost while the roles started; starting them again (restart "
                    f"{self.startups.take()} of {self.startups.limit})",
                    flush=True,
                )

    def restart(self, failure: WorkerError) -> int:
        """A failed call on a worker group, to be recovered by a restart from the last checkpoint: its number (from
        1). Raises when the allowance is used up: WorkersLost for a lost process (worth a retry), else `failure`."""
        if not self.restarts.left:
            if isinstance(failure, WorkerDiedError):  # a process lost, not a call that raised
                raise WorkersLost(
                    f"{first_line(failure)}: runtime.max_restarts={self.restarts.limit} allows no more restarts; "
                    f"exiting {EXIT_TEMPFAIL} (EX_TEMPFAIL): {self.resume_hint} (a job controller's retry does)"
                ) from failure
            raise failure
        return self.restarts.take()

    def scope(self, failure: WorkerError, restartable: tuple[str, ...]) -> Literal["role", "all"]:
        """What a restart after `failure` replaces: the failed role's ranks where runtime.restart_scope=role and its
        group can be replaced alone (`restartable`: the run's roles that can), else every role."""
        return "role" if self.scope_setting == "role" and failure.role in restartable else "all"

    def may_heal(self, failure: WorkerError, role: str) -> bool:
        """Whether `failure` of a call on `role`'s ranks may be healed from a live replica (one is left)."""
        return failure.role == role and self.heals.left > 0

    def healed(self) -> int:
        """A heal made: its number (from 1)."""
        return self.heals.take()

    def replace_engine(self, rank: int, method: str) -> int:
        """An engine found dead in `method`, to be replaced: its number (from 1); WorkerDiedError when the
        allowance is used up (the death is then the run's failure)."""
        if not self.engines.left:
            raise WorkerDiedError(
                "rollout",
                rank,
                method,
                f"the engine's actor died, and all runtime.max_engine_replacements={self.engines.limit} "
                "engine replacements of this run are used up",
            )
        return self.engines.take()
