"""The one place a run recovers from lost workers: every command (train, sft, dpo, rm) runs under a Supervisor.

A command says what it runs: a builder of its run (the roles, data, logger, checkpointer: `loops.context`'s
`build_context`, handed in as a callable because the loops sit above this room) and a body, a function of (the
run, the `Attempt`) that starts fresh or resumes from the newest whole checkpoint and trains to the end. The
supervisor builds the run, calls the body, waits for the last save, and on a failed call on a worker group
(`WorkerError`: a rank that died, a collective one broke, a call past its timeout):
- drops the save in flight (it may have died with the ranks; it is `latest` only if it became whole);
- takes a restart from the run's `Recovery` (runtime.max_restarts; past it: `WorkersLost`, one line naming what
  was lost and `loopline <command> --resume out_dir=...`, exit 75 from the CLI, never a traceback);
- restarts the failed role's group alone where runtime.restart_scope=role allows it (ray: the engines and env
  workers keep running), else stops every role and builds the run again;
- calls the body again as a resume from the newest whole checkpoint; the body's `Attempt.recovered` logs the time
  from the failure to the loaded checkpoint (recover_<role>_s on the next metrics row).
What is healed without a restart (a trainer rank from a live replica, an engine replaced in its bundle, an env
task retried) is healed below, inside the call, against the same `Recovery`'s allowances.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from loopline.checkpoint.state import Checkpointer
from loopline.distributed.workers import WorkerError
from loopline.runtime.config import RuntimeConfig
from loopline.runtime.protocols import Rollout
from loopline.runtime.recovery import Recovery
from loopline.runtime.roles import RESTARTABLE

T = TypeVar("T")


class SupervisedRun(Protocol):
    """What the supervisor needs of a built run (`loops.context.RunContext`)."""

    checkpoints: Checkpointer
    rollout: Rollout
    restart_group: Callable[[str], None] | None  # ray: replace one role's ranks alone

    def close(self) -> None:
        """Finish the save in flight, flush the logs, stop the roles' workers."""


C = TypeVar("C", bound=SupervisedRun)


@dataclass(frozen=True)
class Attempt:
    """One call of a command's body: how it starts, and (after a failure) what it recovers from."""

    # from the newest whole checkpoint (a --resume, or any attempt after a failure)
    resume: bool
    # what a --resume changed in the saved config; None: a restart, same config
    changes: dict[str, tuple] | None
    # time.perf_counter() when the failure this attempt recovers from was caught
    failed_at: float | None = None
    # the role of that failure ("actor", "rollout", "env", "ref", "critic")
    failed_role: str = ""

    def recovered(self, note: Callable[[dict[str, float]], None]) -> None:
        """Say (and `note` for the next metrics row) how long the recovery took, once the checkpoint is loaded."""
        if self.failed_at is None:
            return
        seconds = time.perf_counter() - self.failed_at
        print(
            f"recovered in {seconds:.1f}s from a failure of role '{self.failed_role}' (restarted, checkpoint "
            "loaded)",
            flush=True,
        )
        note({f"recover_{self.failed_role}_s": seconds})  # on the row of the first step trained after it


class Supervisor(Generic[C]):
    """Runs one command's body on its run until it ends, restarting after lost workers as its Recovery allows."""

    def __init__(
        self, runtime: RuntimeConfig, command: str, out_dir: str, build: Callable[[Recovery], C], seed: int
    ) -> None:
        """build: the run of this command, its roles started (called again after a restart of every role), given
        the recovery it must hand its roles (heals and engine replacements count against the same allowances);
        seed: the run's, for engines whose generators go back to their start."""
        self.command, self.build, self.seed = command, build, seed
        self.recovery = Recovery(runtime, f"continue with `loopline {command} --resume out_dir={out_dir}`")

    def run(
        self, body: Callable[[C, Attempt], T], resume: bool, changes: dict[str, tuple] | None
    ) -> tuple[C, T]:
        """`body` until it returns and its last checkpoint is whole; the last run (closed) and the body's result.
        resume: the first attempt resumes (--resume); changes: what that resume changed in the saved config."""
        attempt = Attempt(resume, changes)
        run = self.build(self.recovery)
        # ray: the engines' generators as they start, for a restart of one group alone (_restart_group)
        engine_rng = run.rollout.rng_states() if run.restart_group is not None else []
        try:
            while True:
                try:
                    result = body(run, attempt)
                    run.checkpoints.wait()  # the last save too: a rank lost under it is recovered as any
                    return run, result
                except WorkerError as e:
                    attempt = Attempt(True, None, time.perf_counter(), e.role)
                    run = self._recover(run, e, engine_rng)
        finally:
            run.close()

    def _recover(self, run: C, failure: WorkerError, engine_rng: list[torch.Tensor | None]) -> C:
        """After `failure`: the run to resume on, its failed group restarted alone, or every role built again."""
        run.checkpoints.abandon()  # a save in flight may have died with the ranks
        restart = self.recovery.restart(failure)  # raises when no restart is left
        print(failure, flush=True)  # now: the restart takes seconds
        limit = self.recovery.restarts.limit
        restartable = RESTARTABLE if run.restart_group is not None else ()
        if self.recovery.scope(failure, restartable) == "role" and _restart_group(run, failure):
            # the engines ran on: their generators go back to their start, as new engines' would be (a GRPO
            # checkpoint then restores its own; the other phases' hold none and start from these)
            run.rollout.set_rng_states(engine_rng, reseed=self.seed)
            group = "trainer" if failure.role == "actor" else failure.role
            print(
                f"restarted the {group} group; resuming from the last checkpoint (restart {restart} of {limit}; "
                "the other roles, engines and env workers kept running)"
            )
            return run
        print(f"restarting the roles from the last checkpoint (restart {restart} of {limit})")
        t0 = time.perf_counter()
        run.close()  # also stops the Ray workers (and a Ray this run started)
        t1 = time.perf_counter()
        run = self.build(self.recovery)
        print(f"roles stopped in {t1 - t0:.2f}s, started in {time.perf_counter() - t1:.2f}s", flush=True)
        return run


def _restart_group(run: SupervisedRun, failure: WorkerError) -> bool:
    """Replace the failed role's ranks alone (ray); False when that fails (then every role restarts)."""
    assert run.restart_group is not None  # Recovery.scope said "role"
    try:
        run.restart_group(failure.role)
    except WorkerError as e:
        print(f"restarting the {failure.role} group failed ({e}): restarting every role")
        return False
    return True
