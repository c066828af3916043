"""Worker pool: every sample's outcome arrives exactly once, whatever happens to the workers.

Workers are real spawned processes (and real Ray actors on a local 2-CPU Ray); failures are real
SIGKILLs and hangs. The task functions live in this module so that workers can import them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path

import pytest

from loopline.envs.pool import EnvPoolConfig, Outcome, WorkerPool


def _poll(done: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """Wait until done() is true, checking every 10 ms; fail naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"waited {timeout_s:g}s for {what}"
        time.sleep(0.01)


def square_when_told(item: tuple[int, str, int, str]) -> tuple[int, int]:
    """x² (and the process that ran it) once `n` worker processes have started a task here (each checks in
    at the directory `meet`; n = 0: no check-in) and the file `gate` is gone ("" = no gate), after a pause.

    Tests order events with it instead of sleeping: a task holds its worker busy until the test says so.
    """
    x, meet, n, gate = item
    if n:
        Path(meet, str(os.getpid())).touch()
        _poll(lambda: len(os.listdir(meet)) >= n, f"{n} workers to check in at {meet}")
    if gate:
        _poll(lambda: not os.path.exists(gate), f"{gate} to be removed")
    time.sleep(0.05)  # the pace of the batch: a retiring worker's last task ends long before the rest
    return x * x, os.getpid()


def square_slowly(x: int) -> tuple[int, int]:
    """x², after a pause long enough to catch the worker busy; also says which process ran it."""
    time.sleep(0.15)
    return x * x, os.getpid()


def hang_on_request(x: object) -> object:
    if x == "hang":
        time.sleep(600)
    return x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is not allowed")
    return x


def return_unpicklable(x: int) -> object:
    return lambda: x


def timed(x: int) -> tuple[float, float]:
    start = time.monotonic()
    time.sleep(0.2)
    return start, time.monotonic()


def _until_dead(pid: int, timeout_s: float = 60.0) -> None:
    """Poll until process `pid` has ended (a zombie or gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        assert time.monotonic() < deadline, f"process {pid} still alive after SIGKILL"
        time.sleep(0.01)


def _check_exactly_once(outcomes: list[Outcome], ids: list[Hashable]) -> dict[Hashable, Outcome]:
    counts = Counter(o.sample_id for o in outcomes)
    assert all(n == 1 for n in counts.values()), [k for k, n in counts.items() if n > 1]
    assert set(counts) == set(ids)
    return {o.sample_id: o for o in outcomes}


def test_every_sample_gets_exactly_one_outcome(tmp_path: Path) -> None:
    with WorkerPool(square_when_told, EnvPoolConfig(num_workers=2)) as pool:
        # each task waits until both workers hold one: neither can run the whole batch alone
        outcomes = pool.map({f"s{i}": (i, str(tmp_path), 2, "") for i in range(12)})
    assert set(outcomes) == {f"s{i}" for i in range(12)}
    assert all(
        o.ok and o.value[0] == i * i and o.attempts == 1
        for i, o in ((int(k[1:]), o) for k, o in outcomes.items())
    )
    assert len({o.worker for o in outcomes.values()}) == 2  # both workers took part


class BusyWorkerKiller(threading.Thread):
    """SIGKILLs `count` workers, each one the pool reports busy, while a batch runs. Before the next kill it
    waits until the pool has dropped the last victim: each kill is a death of its own."""

    def __init__(self, pool: WorkerPool, count: int) -> None:
        super().__init__(daemon=True)
        self.pool, self.count = pool, count
        self.killed: list[tuple[int, Hashable]] = []  # (pid, sample id it was busy with)

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while len(self.killed) < self.count and time.monotonic() < deadline:
            busy = [w for w in self.pool.workers() if w.busy_with is not None and w.pid is not None]
            if not busy:
                time.sleep(0.005)
                continue
            pid = busy[0].pid
            os.kill(pid, signal.SIGKILL)
            self.killed.append((pid, busy[0].busy_with))
            if len(self.killed) < self.count:
                dropped = lambda gone=pid: gone not in {w.pid for w in self.pool.workers()}  # noqa: E731
                _poll(dropped, f"the pool to drop worker {pid}")


def test_sigkill_mid_batch_loses_nothing_and_counts_nothing_twice() -> None:
    ids = list(range(30))
    with WorkerPool(square_slowly, EnvPoolConfig(num_workers=2, max_attempts=3)) as pool:
        pool.map({"warm": 0})  # both workers started
        killer = BusyWorkerKiller(pool, count=2)
        killer.start()
        outcomes = list(pool.imap({i: i for i in ids}))
        killer.join()
        assert len(pool.workers()) == 2  # the dead were replaced
    assert len(killer.killed) == 2
    by_id = _check_exactly_once(outcomes, ids)
    assert all(o.ok and o.value[0] == i * i for i, o in by_id.items())
    # Each kill loses the task its worker was on (the next one, if it had just answered): exactly those
    # tasks ran again, each failure names a killed worker, and the answer came from another one. Under load
    # both kills can hit the same task (its retry landed on the next worker killed): then it ran 3 times.
    killed_pids = {pid for pid, _ in killer.killed}
    retried = [o for o in outcomes if o.attempts > 1]
    assert 1 <= len(retried) <= 2
    assert sum(len(o.failures) for o in outcomes) == 2  # one lost attempt per kill, none twice
    for o in retried:
        assert o.attempts == 1 + len(o.failures)
        died_on = {pid for pid in killed_pids for failure in o.failures if f"(pid {pid}) died" in failure}
        assert len(died_on) == len(o.failures)  # each failure names a killed worker, a different one
        assert o.value[1] not in died_on  # the retry ran on another worker
    # how long each lost task took to recover: from the loss of its first attempt to its answer
    assert all(0 < o.recovered_s < 60 for o in retried) and all(
        o.recovered_s == 0 for o in outcomes if o.attempts == 1
    )


def test_hung_task_is_killed_retried_then_reported() -> None:
    config = EnvPoolConfig(num_workers=2, task_timeout_s=1.0, max_attempts=2)
    start = time.monotonic()
    with WorkerPool(hang_on_request, config) as pool:
        outcomes = pool.map({"a": "a", "h": "hang", "b": "b", "c": "c"})
    assert time.monotonic() - start < 30
    assert outcomes["h"].error is not None and "timed out" in outcomes["h"].error
    assert outcomes["h"].attempts == 2 and outcomes["h"].value is None
    assert all(outcomes[k].ok and outcomes[k].value == k for k in "abc")


def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_a_tasks_own_time_limit_replaces_the_pools() -> None:
    """A task given a longer limit may outlast task_timeout_s; one given a shorter limit is cut at it."""
    config = EnvPoolConfig(num_workers=2, task_timeout_s=1.0, max_attempts=1)
    with WorkerPool(sleep_for, config) as pool:
        outcomes = pool.map({"long": 2.0, "cut": 2.0}, timeouts={"long": 30.0})
        assert outcomes["long"].ok and outcomes["long"].value == 2.0  # past the pool's 1 s: its own 30 s
        assert "timed out after 1s" in (outcomes["cut"].error or "")  # no limit of its own: the pool's
        short = pool.map({"x": 0.8}, timeouts={"x": 0.3})["x"]
    assert not short.ok and "timed out after 0.3s" in (short.error or "")


def test_exception_in_fn_is_an_outcome_and_not_retried() -> None:
    with WorkerPool(fail_on_three, EnvPoolConfig(num_workers=1)) as pool:
        outcomes = pool.map({i: i for i in range(5)})
    assert outcomes[3].error == "ValueError: three is not allowed" and outcomes[3].attempts == 1
    assert [outcomes[i].value for i in (0, 1, 2, 4)] == [0, 1, 2, 4]


def test_unpicklable_result_is_an_error_outcome() -> None:
    with WorkerPool(return_unpicklable, EnvPoolConfig(num_workers=1)) as pool:
        outcome = pool.map({"x": 1})["x"]
    assert not outcome.ok and "could not be sent back" in (outcome.error or "")


def test_workers_join_and_leave_while_a_batch_runs(tmp_path: Path) -> None:
    ids = list(range(60))
    names_seen: set[str] = set()
    three_workers_seen = threading.Event()
    gate = tmp_path / "gate"
    gate.touch()
    meet = tmp_path / "meet"
    meet.mkdir()
    # The first tasks wait until three workers hold one (so the one worker cannot finish the batch before the
    # others join); the rest wait at the gate, opened once two workers are leaving.
    items = {i: (i, str(meet), 3, "") if i < 6 else (i, "", 0, str(gate)) for i in ids}
    with WorkerPool(square_when_told, EnvPoolConfig(num_workers=1)) as pool:

        def resize() -> None:  # another thread, as an autoscaler would
            _poll(lambda: any(w.busy_with is not None for w in pool.workers()), "the batch to start")
            pool.add_workers(2)
            three_workers_seen.wait(timeout=60)
            pool.remove_workers(2)
            gate.unlink()

        resizer = threading.Thread(target=resize)
        resizer.start()
        outcomes = []
        for outcome in pool.imap(items):
            outcomes.append(outcome)
            names_seen.add(outcome.worker)
            if len(names_seen) >= 3:
                three_workers_seen.set()
        resizer.join()
        assert pool.num_workers == 1 and len(pool.workers()) == 1
    by_id = _check_exactly_once(outcomes, ids)
    assert all(o.ok and o.value[0] == i * i and o.attempts == 1 for i, o in by_id.items())
    assert len(names_seen) == 3  # the added workers did run tasks
    # After the removal only one worker is left to finish the batch.
    last = outcomes[-5:]
    assert len({o.worker for o in last}) == 1


def test_concurrency_limit_is_respected() -> None:
    with WorkerPool(timed, EnvPoolConfig(num_workers=3, max_concurrency=2)) as pool:
        outcomes = pool.map({i: i for i in range(8)})
    spans = sorted(o.value for o in outcomes.values())
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most <= 2


def test_abandoned_batch_leaves_no_stale_results(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    meet = tmp_path / "meet"
    meet.mkdir()
    # every old task waits until both workers hold one; all but the first then wait at the gate
    old = {("old", i): (i, str(meet), 2, str(gate) if i else "") for i in range(10)}
    with WorkerPool(square_when_told, EnvPoolConfig(num_workers=2)) as pool:
        batch = pool.imap(old)
        assert next(batch).sample_id == ("old", 0)
        assert [w.busy_with for w in pool.workers() if w.busy_with is not None] == [("old", 1)]
        batch.close()  # abandoned with ("old", 1) in flight
        gate.unlink()  # its worker, were it still alive, would answer now, during the next batch
        outcomes = list(pool.imap({("new", i): (i, "", 0, "") for i in range(6)}))
        assert len(pool.workers()) == 2
    by_id = _check_exactly_once(outcomes, [("new", i) for i in range(6)])
    assert all(o.value[0] == k[1] ** 2 for k, o in by_id.items())


def test_idle_worker_death_is_repaired_without_using_attempts() -> None:
    with WorkerPool(square_slowly, EnvPoolConfig(num_workers=2)) as pool:
        pool.map({"warm": 1})
        victim = pool.workers()[0].pid
        os.kill(victim, signal.SIGKILL)
        _until_dead(victim)  # dead before the batch: the pool must see it, not find out from a lost task
        outcomes = pool.map({i: i for i in range(4)})
    assert all(o.ok and o.attempts == 1 for o in outcomes.values())


def test_sigint_leaves_local_workers_quiet_and_working(capfd) -> None:
    """Ctrl-C reaches every process of the terminal's group: the run's process stops the run at the step's end,
    and its workers must go on scoring that step, without a KeyboardInterrupt traceback each."""
    with WorkerPool(square_slowly, EnvPoolConfig(num_workers=2)) as pool:
        pool.map({"warm": 1})
        pids = [w.pid for w in pool.workers()]
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        outcomes = pool.map({i: i for i in range(4)})
        assert [w.pid for w in pool.workers()] == pids and pool.workers_lost == 0
    assert all(o.ok and o.attempts == 1 for o in outcomes.values())
    assert "KeyboardInterrupt" not in capfd.readouterr().err
    # and while they start (importing for seconds): a Ctrl-C in the run's first seconds
    with WorkerPool(square_slowly, EnvPoolConfig(num_workers=2)) as pool:
        for w in pool.workers():
            os.kill(w.pid, signal.SIGINT)
        outcomes = pool.map({i: i for i in range(4)})
        assert pool.workers_lost == 0
    assert all(o.ok and o.attempts == 1 for o in outcomes.values())
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        EnvPoolConfig(max_attempts=0)


# ---------------------------------------------------------------------------------------------
# Ray actors
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ray_actor_killed_mid_batch_loses_nothing(ray_cluster) -> None:
    from loopline.envs.code import CodeProblem, ScoreJob, run_score_job
    from loopline.envs.sandbox import SandboxConfig

    problem = CodeProblem("add", "def add(a, b):\n", "add", "def check(c):\n    assert c(2, 3) == 5\n")
    jobs = {
        i: ScoreJob(problem, "    return a + b\n" if i % 2 else "    return a - b\n", SandboxConfig())
        for i in range(10)
    }
    with WorkerPool(run_score_job, EnvPoolConfig(backend="ray", num_workers=2, ray_num_cpus=0.5)) as pool:
        killer = BusyWorkerKiller(pool, count=1)
        killer.start()
        outcomes = list(pool.imap(jobs))
        killer.join()
    assert len(killer.killed) == 1
    by_id = _check_exactly_once(outcomes, list(jobs))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    assert [by_id[i].value.passed for i in range(10)] == [bool(i % 2) for i in range(10)]
    retried = [o for o in outcomes if o.attempts > 1]
    assert len(retried) == 1 and f"(pid {killer.killed[0][0]}) died" in retried[0].failures[0]
