"""The supervisor's rules on their own: what it does after a failed call, in which order, and when it gives up. The
mechanisms run for real on Ray in test_fault_ray_phases.py (sft, dpo, rm) and test_fault_ray.py (train); here a
run is a record of what was asked of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loopline.distributed.workers import WorkerDiedError
from loopline.errors import WorkersLost
from loopline.runtime.config import RuntimeConfig
from loopline.runtime.recovery import Recovery
from loopline.runtime.supervisor import Attempt, Supervisor

pytestmark = pytest.mark.unit


def died(role: str = "actor") -> WorkerDiedError:
    return WorkerDiedError(role, 1, "sft_step", "the rank's actor died")


@dataclass
class Saves:
    """A run's checkpointer as the supervisor sees it: the last save can fail once."""

    log: list[str]
    fail_wait: list[WorkerDiedError] = field(default_factory=list)

    def wait(self) -> None:
        self.log.append("wait")
        if self.fail_wait:
            raise self.fail_wait.pop()

    def abandon(self) -> None:
        self.log.append("abandon")


@dataclass
class Engines:
    log: list[str]

    def rng_states(self) -> list:
        return ["start"]

    def set_rng_states(self, states: list, reseed: int) -> bool:
        self.log.append(f"engine rng {states} seed {reseed}")
        return True


class Run:
    """A built run: its checkpointer, engines, and (ray) a way to restart one role's group."""

    def __init__(self, n: int, log: list[str], groups: bool, fail_wait: list[WorkerDiedError]) -> None:
        self.n, self.log = n, log
        self.checkpoints, self.rollout = Saves(log, fail_wait), Engines(log)
        self.restart_group = (lambda role: log.append(f"restart {role} group of run {n}")) if groups else None

    def close(self) -> None:
        self.log.append(f"close run {self.n}")


def supervise(
    runtime: RuntimeConfig,
    failures: list[WorkerDiedError],
    groups: bool = True,
    fail_wait: tuple = (),
    log: list[str] | None = None,
) -> tuple[list[str], list[Attempt], Supervisor]:
    """Run a body that fails with `failures` one per call, then returns; (what happened, the attempts made)."""
    log = [] if log is None else log
    attempts: list[Attempt] = []
    built: list[Run] = []
    waits = list(fail_wait)

    def build(recovery: Recovery) -> Run:
        built.append(Run(len(built), log, groups, waits))
        log.append(f"build run {len(built) - 1}")
        return built[-1]

    def body(run: Run, attempt: Attempt) -> str:
        attempts.append(attempt)
        log.append(f"body on run {run.n}")
        if failures:
            raise failures.pop(0)
        return "done"

    supervisor = Supervisor(runtime, "sft", "out", build, seed=7)
    assert supervisor.run(body, resume=False, changes={})[1] == "done"
    return log, attempts, supervisor


def test_a_lost_rank_restarts_its_group_alone_and_the_body_resumes() -> None:
    log, attempts, supervisor = supervise(RuntimeConfig(max_restarts=1), [died()])
    assert log == [
        "build run 0", "body on run 0", "abandon", "restart actor group of run 0", "engine rng ['start'] seed 7",
        "body on run 0", "wait", "close run 0",
    ]  # fmt: skip
    assert [(a.resume, a.failed_role) for a in attempts] == [(False, ""), (True, "actor")]
    assert attempts[0].changes == {} and attempts[1].changes is None  # a restart: the same config
    assert supervisor.recovery.restarts.used == 1


def test_without_a_group_restart_every_role_is_built_again() -> None:
    log, attempts, _ = supervise(RuntimeConfig(max_restarts=1, restart_scope="all"), [died()])
    assert log == ["build run 0", "body on run 0", "abandon", "close run 0", "build run 1", "body on run 1", "wait",
                   "close run 1"]  # fmt: skip
    assert attempts[1].resume


def test_a_rank_lost_under_the_last_save_is_recovered_as_any() -> None:
    log, attempts, _ = supervise(RuntimeConfig(max_restarts=1), [], fail_wait=(died(),))
    assert log[:4] == ["build run 0", "body on run 0", "wait", "abandon"] and log[-2:] == [
        "wait",
        "close run 0",
    ]
    assert len(attempts) == 2 and attempts[1].resume


def test_past_max_restarts_one_line_naming_the_command_to_continue_and_the_run_is_closed() -> None:
    log: list[str] = []
    with pytest.raises(WorkersLost) as lost:
        supervise(RuntimeConfig(max_restarts=1), [died(), died("ref")], log=log)
    assert log[-3:] == [
        "body on run 0",
        "abandon",
        "close run 0",
    ]  # the save in flight dropped, the roles stopped
    line = str(lost.value)
    assert "\n" not in line and line.startswith("role 'ref' rank 1 sft_step(): ")
    assert "runtime.max_restarts=1 allows no more restarts; exiting 75" in line
    assert "continue with `loopline sft --resume out_dir=out`" in line


def test_the_recovery_time_is_said_and_noted_once_the_checkpoint_is_loaded(capsys) -> None:
    notes: list[dict] = []
    Attempt(True, None).recovered(notes.append)  # a --resume: nothing recovered
    assert notes == [] and capsys.readouterr().out == ""
    Attempt(True, None, failed_at=0.0, failed_role="actor").recovered(notes.append)
    assert list(notes[0]) == ["recover_actor_s"] and notes[0]["recover_actor_s"] > 0
    assert "from a failure of role 'actor' (restarted, checkpoint loaded)" in capsys.readouterr().out
