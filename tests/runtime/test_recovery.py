"""The run's one owner of recovery: each way back (start again, restart a role, heal a rank, replace an engine)
asks it, and it counts them against the run's settings. The mechanisms are tested where they run on Ray
(test_fault_ray.py, test_elastic_engines.py); this checks the rules and counts on their own."""

from __future__ import annotations

import pytest

from loopline.distributed.workers import WorkerDiedError, WorkerError, WorkerTimeoutError
from loopline.errors import WorkersLost
from loopline.runtime.config import RuntimeConfig
from loopline.runtime.recovery import Allowance, Recovery

pytestmark = pytest.mark.unit


def died(role: str = "actor", rank: int = 1) -> WorkerDiedError:
    return WorkerDiedError(role, rank, "policy_step", "the rank's actor died\nRay's long account")


def test_an_allowance_counts_to_its_limit_and_then_refuses() -> None:
    allowance = Allowance("runtime.max_restarts", 2)
    assert [allowance.take(), allowance.take()] == [1, 2]
    assert allowance.left == 0
    with pytest.raises(ValueError, match="runtime.max_restarts=2"):
        allowance.take()


def test_restarts_are_numbered_then_a_lost_process_ends_the_run_worth_a_retry() -> None:
    recovery = Recovery(RuntimeConfig(max_restarts=2), "continue with `loopline train --resume out_dir=r`")
    assert [recovery.restart(died()), recovery.restart(died())] == [1, 2]
    with pytest.raises(WorkersLost) as lost:
        recovery.restart(died())
    line = str(lost.value)
    assert line.startswith("role 'actor' rank 1 policy_step(): the rank's actor died: runtime.max_restarts=2")
    assert "Ray's long account" not in line  # one line, not Ray's whole account
    assert "exiting 75 (EX_TEMPFAIL): continue with `loopline train --resume out_dir=r`" in line


def test_a_failure_that_is_not_a_death_is_raised_as_it_is_when_no_restart_is_left() -> None:
    recovery = Recovery(RuntimeConfig(max_restarts=0))
    timeout = WorkerTimeoutError("actor", 0, "policy_step", "no answer in 60 s")
    with pytest.raises(WorkerTimeoutError) as raised:
        recovery.restart(timeout)
    assert raised.value is timeout


def test_the_scope_is_the_failed_role_only_where_the_setting_and_the_run_allow() -> None:
    role, whole = Recovery(RuntimeConfig(restart_scope="role")), Recovery(RuntimeConfig(restart_scope="all"))
    assert role.scope(died("actor"), ("actor", "critic", "ref")) == "role"
    assert role.scope(died("rollout"), ("actor", "critic", "ref")) == "all"  # engines: not a group alone
    assert role.scope(died("actor"), ()) == "all"  # the local backend replaces no group alone
    assert whole.scope(died("actor"), ("actor", "critic", "ref")) == "all"


def test_start_up_starts_again_after_a_lost_rank_then_gives_up_with_one_line() -> None:
    recovery = Recovery(RuntimeConfig(max_restarts=1))
    calls, stops = [], []

    def start() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise died(rank=0)
        return "started"

    assert recovery.start(start, lambda: stops.append(1)) == "started"
    assert (len(calls), len(stops)) == (2, 1)  # the half-started groups were stopped before the start again

    def always_lost() -> str:
        raise died(rank=1)

    again = Recovery(RuntimeConfig(max_restarts=1))
    stops.clear()
    with pytest.raises(WorkersLost, match="lost while the roles started, and runtime.max_restarts=1"):
        again.start(always_lost, lambda: stops.append(1))
    assert len(stops) == 2
    assert again.restarts.used == 0  # start-up counts apart from the run's restarts


def test_a_rank_that_raised_while_starting_is_not_started_again() -> None:
    recovery = Recovery(RuntimeConfig(max_restarts=3))
    calls = []

    def broken() -> None:
        calls.append(1)
        raise WorkerError("actor", 0, "__init__", "raised ValueError: bad model")

    with pytest.raises(WorkerError, match="bad model"):
        recovery.start(broken, lambda: None)
    assert len(calls) == 1


def test_heals_need_the_failed_role_and_an_allowance_left() -> None:
    recovery = Recovery(RuntimeConfig(max_restarts=1))
    assert not recovery.may_heal(died("ref"), "actor")
    assert recovery.may_heal(died("actor"), "actor")
    assert recovery.healed() == 1
    assert not recovery.may_heal(died("actor"), "actor")


def test_engine_replacements_are_the_runs_then_the_death_is_raised() -> None:
    recovery = Recovery(RuntimeConfig(max_engine_replacements=2))
    assert [recovery.replace_engine(0, "generate"), recovery.replace_engine(1, "receive_weights")] == [1, 2]
    with pytest.raises(WorkerDiedError, match="all runtime.max_engine_replacements=2") as raised:
        recovery.replace_engine(0, "generate")
    assert (raised.value.role, raised.value.rank, raised.value.method) == ("rollout", 0, "generate")
