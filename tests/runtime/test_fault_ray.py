"""Trainer-rank death on the ray backend (as the roles start, then mid-run, in one run), and resuming a 2-rank
checkpoint on 1 rank; the same death with spare ranks (runtime.trainer_standby); and a reference rank's death; each
against a run never interrupted.

`loopline train` in a process of its own that joins the session's Ray (tests/conftest.py) by address (2 FSDP2
trainer ranks, 1 engine, 1 env worker) with runtime.max_restarts=1. Once GRPO step 1 is logged, the test
SIGKILLs one trainer rank: a real Ray actor process, found among the session Ray's processes (descendants of
this one) by its process title (ray::ActorWorker). The run must
restart its trainer group alone from the newest checkpoint by itself (the trainer ranks rebuilt in the warm
processes started beside them, the same engine process), print the time it took to recover, and finish with every step logged once, every sample trained
once (the ledger) and the weights of the same run never interrupted, bit for bit (deterministic=true). Then the run's checkpoint,
written as two ranks' DCP shards, resumes on the local backend (one rank): DCP reshards the weights and
the optimizer state, and the run continues from there (in this process: the local backend needs no Ray). Checkpoints are saved asynchronously here, so
the kill may also land in a rank's background write: such a checkpoint never becomes latest.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.cli import main
from loopline.metrics.logger import read_metrics

pytestmark = pytest.mark.slow

ARGS = [
    "sft.steps=1", "sft.batch_size=4", "sft.micro_batch_size=2", "sft.eval_every=0",
    "grpo.stop_at_accuracy=null", "grpo.steps=5", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.micro_batch_size=2",
    "grpo.entropy_coef=0.01", "grpo.eval_every=0", "data.task.num_train=20", "data.task.num_eval=4",
    "eval.num_prompts=4", "checkpoint_every=1", "progress=false", "tensorboard=false", "threads=1",
    "deterministic=true",
]  # fmt: skip
RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=1",
    "runtime.call_timeout_s=60", "runtime.max_restarts=1",
    "checkpoint.async_save=true",  # each rank writes its shards in a thread while training goes on
]  # fmt: skip
RUN_TIMEOUT_S = 400
FINAL = "checkpoints/grpo-000005/model/model.safetensors"


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process on this machine."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended meanwhile
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants_titled(root: int, title: str) -> list[int]:
    """Pids under `root` whose command line (a Ray worker's process title) starts with `title`."""
    tree, found, todo = _children(), [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            todo.append(child)
            try:
                if (Path("/proc") / str(child) / "cmdline").read_bytes().startswith(title.encode()):
                    found.append(child)
            except OSError:
                pass
    return found


def _started(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot; a process that ended: after every other."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 2**63


def _now_ticks() -> int:
    """Clock ticks after boot now, as _started counts them."""
    return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _trainer_processes() -> list[int]:
    """The session Ray's trainer-rank processes (ray::ActorWorker), oldest first: the ranks, then their spares or
    warm processes (started once the ranks were built; titled so once their imports are done)."""
    return sorted(_descendants_titled(os.getpid(), "ray::ActorWorker"), key=_started)


def _rows(run: Path) -> list[dict]:
    try:
        return read_metrics(run)
    except (FileNotFoundError, ValueError):  # not written yet, or a line half-written
        return []


def _grpo_steps(run: Path) -> list[int]:
    return [r["step"] for r in _rows(run) if r.get("phase") == "grpo"]


def _uninterrupted(tmp_path_factory: pytest.TempPathFactory, extra: list[str]) -> Path:
    import ray

    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "train", *ARGS, *RAY, f"runtime.cluster.address={address}", *extra,
         f"out_dir={run}"],
        env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' job on the session's Ray, never interrupted: a restarted run must end with its weights."""
    return _uninterrupted(tmp_path_factory, ["runtime.trainer_warm=false"])  # no restart: no use for them


def _same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    want, got = load_file(a / FINAL), load_file(b / FINAL)
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_trainer_ranks_killed_as_the_roles_start_and_mid_run_restart_then_resume_on_one_rank(
    uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trainer rank 1 SIGKILLed in its constructor: the roles start again (runtime.max_restarts=1 covers start-up as
    it covers a step); then, once GRPO step 1 is logged, a trainer rank is killed: the trainer group alone restarts
    from the last checkpoint (restart 1 of 1: start-up and the run count their restarts apart), its new ranks built
    in the warm processes that waited beside the ranks (the default where restarts are on). The run ends with
    the weights of the run never interrupted, then resumes on one local rank. (One run for both losses: each start
    of a Ray run costs the suite ~30 s.)"""
    import ray

    run, markers = tmp_path / "run", tmp_path / "markers"
    marker = markers / "init_actor_1.paused"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "LOOPLINE_PAUSE_AT": "init:actor:1",
           "LOOPLINE_PAUSE_DIR": str(markers)}  # fmt: skip
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "train", *ARGS, *RAY, f"runtime.cluster.address={address}",
         f"out_dir={run}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None, (
                f"run ended (rc {proc.returncode}) early: {proc.communicate()[1][-3000:]}"
            )
            assert time.monotonic() < deadline, "nothing paused at init:actor:1"
            time.sleep(0.05)
        os.kill(int(marker.read_text()), signal.SIGKILL)  # the rank's own process, in its constructor
        while 1 not in _grpo_steps(run):
            assert proc.poll() is None, (
                f"run ended (rc {proc.returncode}) early: {proc.communicate()[1][-3000:]}"
            )
            assert time.monotonic() < deadline, "run did not reach GRPO step 1"
            time.sleep(0.2)
        # the two ranks, then their warm processes (runtime.trainer_warm's default with max_restarts > 0), if their
        # imports are done
        trainers = _trainer_processes()
        ranks = trainers[:2]
        engines = _descendants_titled(os.getpid(), "ray::EngineWorker")
        assert 2 <= len(trainers) <= 4 and len(engines) == 1, (trainers, engines)
        killed = _now_ticks()
        os.kill(ranks[-1], signal.SIGKILL)
        while 3 not in _grpo_steps(run):  # a step trained after the restart
            assert proc.poll() is None and time.monotonic() < deadline, "run did not reach GRPO step 3"
            time.sleep(0.05)
        # the trainer ranks were replaced by processes that were there before the kill (the warm processes: none
        # was started for them), the live old rank killed by the restart (Ray ends a process asynchronously: it
        # may outlive a fast restart); the engine kept running (its process is the same)
        while set(after := _trainer_processes()) & set(ranks):
            assert time.monotonic() < deadline, f"old trainer ranks still running: {trainers} -> {after}"
            time.sleep(0.1)
        assert len(after) >= 2 and all(_started(p) < killed for p in after[:2]), (trainers, after, killed)
        assert _descendants_titled(os.getpid(), "ray::EngineWorker") == engines
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    # the loss as the roles started
    assert "role 'actor' rank 1 __init__(): " in out
    assert "lost while the roles started; starting them again (restart 1 of 1)" in out
    assert "Traceback" not in err
    # the loss mid-run
    assert (
        "role 'actor' rank" in out.split("lost while the roles started")[1]
    )  # the failure names the role and rank
    assert "restarted the trainer group; resuming from the last checkpoint (restart 1 of 1" in out
    with capsys.disabled():  # the time to recover, shown with -s
        print(next(line for line in out.splitlines() if "recovered in " in line))
    # every step logged once, every sample trained once, across the restarts
    rows = read_metrics(run)
    assert [(r["phase"], r["step"]) for r in rows] == [("sft", 0), ("sft", 1)] + [
        ("grpo", s) for s in range(6)
    ]
    ledger = read_ledger(run)
    assert [(r["phase"], r["step"]) for r in ledger] == [("sft", 1)] + [("grpo", s) for s in range(1, 6)]
    assert not repeats(ledger)
    assert _same_weights(run, uninterrupted)
    final = run / "checkpoints" / "grpo-000005"
    assert sorted(p.name for p in (final / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # 2 ranks -> 1: the local backend, in this process, resumes from the two ranks' shards and trains one more step
    # (--resume starts from the saved config, which is ray: the backend is changed explicitly)
    local = ["runtime.backend=local", "runtime.trainer_ranks=1"]
    capsys.readouterr()
    assert main(["train", "--resume", *ARGS, *local, "grpo.steps=6", f"out_dir={run}"]) == 0
    assert f"resumed from {final} (grpo step 5)" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run) if r["phase"] == "grpo"] == [0, 1, 2, 3, 4, 5, 6]
    from safetensors.torch import load_file

    w5 = load_file(final / "model" / "model.safetensors")
    w6 = load_file(run / "checkpoints" / "grpo-000006" / "model" / "model.safetensors")
    step = max(float((w6[k] - w5[k]).abs().max()) for k in w5)
    assert 0 < step < 3e-3, step  # one AdamW step on from the 2-rank weights (not from a fresh init)


def _act_at_step_1(
    run: Path, extra: list[str], act: Callable[[subprocess.Popen], None], env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Start the tests' job on the session's Ray (with `extra`, and `env` added to its environment), call `act` on
    it once GRPO step 1 is logged, then wait for it to end: (exit status, stdout, stderr)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "train", *ARGS, *RAY, f"runtime.cluster.address={address}", *extra,
         f"out_dir={run}"],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while 1 not in _grpo_steps(run):
            if proc.poll() is not None:  # ended early: its own account says why
                out, err = proc.communicate()
                raise AssertionError(
                    f"run exited {proc.returncode} before GRPO step 1:\n{out[-2000:]}{err[-3000:]}"
                )
            assert time.monotonic() < deadline, "run did not reach GRPO step 1"
            time.sleep(0.05)
        act(proc)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return proc.returncode, out, err


def test_a_killed_trainer_rank_replaced_by_its_spare_ends_bitwise_as_an_uninterrupted_run(
    uninterrupted: Path, tmp_path: Path
) -> None:
    """runtime.trainer_standby: the dead group's places go to spares built ahead (no new process is started), and
    the run, resumed from its last checkpoint, ends with the weights of a run never interrupted, bit for bit."""
    run = tmp_path / "killed"
    # the oldest trainer process: a rank (the spares start once the ranks are ready; they may still be importing
    # torch, then the restart waits for them)
    status, out, err = _act_at_step_1(
        run, ["runtime.trainer_standby=true"], lambda _: os.kill(_trainer_processes()[0], signal.SIGKILL)
    )
    assert status == 0, out[-3000:] + err[-3000:]
    assert "trainer ranks restarted in " in out + err and "recovered in " in out + err
    assert not repeats(read_ledger(run))
    assert _same_weights(run, uninterrupted)


@pytest.mark.heavy
def test_a_rank_lost_under_the_last_checkpoint_restarts_and_ends_bitwise_as_an_uninterrupted_run(
    uninterrupted: Path, tmp_path: Path
) -> None:
    """Trainer rank 1 is lost as the run's last checkpoint finishes in the background (checkpoint.async_save),
    after the last step: the run restarts its trainer from the last whole checkpoint, trains the last step again
    and ends with the weights of a run never interrupted (the save's lost rank once ended the run with a
    traceback: it was raised as a RuntimeError, and the last save was waited for outside the recovery)."""
    run, markers = tmp_path / "killed", tmp_path / "markers"
    point = "wait_saved:1:grpo-000005"
    marker = markers / f"{point.replace(':', '_')}.paused"

    def kill_at_the_last_save(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT_S / 2
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, f"no rank paused at {point}"
            time.sleep(0.05)
        assert _grpo_steps(run)[-1] == 5  # the last step logged: only its checkpoint is left
        os.kill(int(marker.read_text()), signal.SIGKILL)

    env = {"LOOPLINE_PAUSE_AT": point, "LOOPLINE_PAUSE_DIR": str(markers)}
    status, out, err = _act_at_step_1(run, [], kill_at_the_last_save, env)
    assert status == 0, out[-3000:] + err[-3000:]
    assert "resuming from the last checkpoint" in out + err and "recovered in " in out + err
    assert "Traceback" not in err, err[-3000:]
    assert not repeats(read_ledger(run))
    assert _same_weights(run, uninterrupted)


@pytest.mark.heavy
def test_killed_reference_then_critic_ranks_restart_their_groups_alone(
    ray_cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PPO with grpo.kl_coef > 0 runs a reference group and a critic group of their own (2 ranks each, their own
    worlds). A reference rank is killed, then, once a step has trained after its restart, a critic rank: each
    death replaces that role's ranks alone (the trainer ranks keep their processes while the run goes on), the run
    resumes from its last checkpoint each time and ends with every step logged once and every sample trained once.
    (Not compared with an uninterrupted run: that would cost the suite another Ray run.)"""
    run = tmp_path / "killed"
    kept: dict[str, list[int]] = {}

    def wait_for_a_step_after(role: str) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT_S / 2
        while not any(
            f"recover_{role}_s" in r for r in _rows(run)
        ):  # the first step trained after the restart
            assert time.monotonic() < deadline, f"no step trained after the {role} restart"
            time.sleep(0.05)

    def kill_a_reference_then_a_critic_rank(_: subprocess.Popen) -> None:
        kept["trainers"] = _trainer_processes()
        os.kill(_descendants_titled(os.getpid(), "ray::ReferenceWorker")[0], signal.SIGKILL)
        wait_for_a_step_after("ref")
        kept["critics"] = _descendants_titled(os.getpid(), "ray::CriticWorker")
        os.kill(kept["critics"][-1], signal.SIGKILL)
        wait_for_a_step_after("critic")
        kept["after"] = _trainer_processes()  # the run is still going: its trainer ranks are alive
        kept["new_critics"] = _descendants_titled(os.getpid(), "ray::CriticWorker")

    ppo = ["grpo.kl_coef=0.05", "grpo.advantage=gae", "grpo.steps=7", "runtime.max_restarts=2"]
    status, out, err = _act_at_step_1(run, ppo, kill_a_reference_then_a_critic_rank)
    assert status == 0, out[-3000:] + err[-3000:]
    assert "ref ranks restarted in " in out + err and "critic ranks restarted in " in out + err
    assert "trainer ranks restarted" not in out + err
    assert "restarted the ref group; resuming from the last checkpoint (restart 1 of 2" in out
    assert "restarted the critic group; resuming from the last checkpoint (restart 2 of 2" in out
    assert "from a failure of role 'ref'" in out and "from a failure of role 'critic'" in out
    with capsys.disabled():  # the times to recover, shown with -s
        print(*(line for line in out.splitlines() if "recovered in " in line or "ranks restarted in" in line))
    # the trainer ranks (the oldest two; their warm processes may have started after them) kept their processes
    assert 2 <= len(kept["trainers"]) <= 4 and kept["trainers"][:2] == kept["after"][:2]
    assert len(kept["critics"]) == len(kept["new_critics"]) == 2
    assert not set(kept["critics"]) & set(
        kept["new_critics"]
    )  # both critic ranks replaced, not only the dead one
    assert _grpo_steps(run) == list(range(8))  # each once
    assert (run / "checkpoints" / "grpo-000007" / "model" / "model.safetensors").is_file()
    assert not repeats(read_ledger(run))
    rows = [r for r in _rows(run) if r.get("phase") == "grpo" and r["step"] > 1]
    assert all(r["kl"] > 0 and math.isfinite(r["value_loss"]) for r in rows)  # the KL term and the critic ran


def test_sigterm_on_ray_ends_the_step_with_a_checkpoint_and_exits_143(ray_cluster, tmp_path: Path) -> None:
    """ray.init replaces the process's SIGTERM handler with one that exits at once (status 15, no checkpoint);
    loopline keeps its own, so a Ray run that is preempted (Kubernetes sends SIGTERM) ends its step with a
    checkpoint and exits 143, as a local run does (tests/test_resume_safety.py)."""
    run = tmp_path / "run"
    status, out, err = _act_at_step_1(
        run, ["runtime.trainer_warm=false"], lambda proc: proc.send_signal(signal.SIGTERM)
    )
    assert status == 143, out[-2000:] + err[-3000:]
    assert "SIGTERM: finishing this step" in err and "Traceback" not in err
    stopped = (run / "checkpoints" / "latest").read_text().strip()
    step = int(stopped.split("-")[1])
    assert stopped.startswith("grpo-") and 1 <= step < 5 and _grpo_steps(run)[-1] == step
    assert f"stopped by SIGTERM after grpo step {step}: checkpoint {run / 'checkpoints' / stopped}" in out
    assert not repeats(read_ledger(run))


@pytest.mark.heavy
def test_trainer_ranks_lost_mid_step_heal_from_their_replica_and_end_bitwise_as_an_uninterrupted_run(
    ray_cluster, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """runtime.trainer_replicas=2 (HSDP: each of the 2 ranks a whole copy). Rank 1 is lost right after its GRPO
    update 2 (rank 0 committed that step too), then rank 0 at the start of update 4 (rank 1 waits for it in a
    collective, and nothing is committed), then rank 0 again as it sends the engine the weights of update 4 (the
    engine's receive breaks; the sync runs again): each time the group heals from the live rank (its shards and optimizer
    state copied into new ranks), no checkpoint is loaded, the committed step is taken as done and the uncommitted
    one trains on the healed group. Every step and sample once, and the weights of the same run (2 replicas) never
    interrupted, bit for bit. (Against 2 FSDP2 ranks without replicas the weights differ by about 1e-7: the grad
    norm sums its squares in another order.)"""
    run, markers = tmp_path / "healed", tmp_path / "markers"
    points = ["policy_step:1:2:after", "policy_step:0:4:before", "send_weights:0:4"]

    def kill_at_the_points(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT_S / 2
        for point in points:
            marker = markers / f"{point.replace(':', '_')}.paused"
            while not marker.exists() or not marker.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, f"no rank paused at {point}"
                time.sleep(0.05)
            os.kill(int(marker.read_text()), signal.SIGKILL)

    extra = ["runtime.trainer_replicas=2", "runtime.max_restarts=3"]
    env = {"LOOPLINE_PAUSE_AT": ",".join(points), "LOOPLINE_PAUSE_DIR": str(markers)}
    status, out, err = _act_at_step_1(run, extra, kill_at_the_points, env)
    assert status == 0, out[-3000:] + err[-3000:]
    healed = [line for line in out.splitlines() if "healed the trainer from a live replica" in line]
    assert len(healed) == 3, out[-3000:]
    assert all("no checkpoint loaded, no step trained again" in line for line in healed)
    assert "lost ranks [1]; state of step 2" in healed[0] and "lost ranks [0]; state of step 3" in healed[1]
    assert "lost ranks [0]; state of step 4" in healed[2]  # the sender, as the engine took its weights
    assert "step 2 of the phase was committed by the live replicas: taken as done" in out
    assert "no replica committed step 4 of the phase: it runs on the healed group" in out
    assert "resuming from the last checkpoint" not in out and "recovered in " not in out
    assert "trainer replicas bitwise equal at the end: yes" in out
    with capsys.disabled():  # the times to heal, shown with -s
        print(*healed, sep="\n")
    assert _grpo_steps(run) == list(range(6))  # each once
    assert sum(r.get("heals", 0) for r in _rows(run)) == 3  # two in step 4: the step's and its sync's
    assert not repeats(read_ledger(run))
    assert _same_weights(run, _uninterrupted(tmp_path_factory, ["runtime.trainer_replicas=2"]))


def _killed_while_starting(run: Path, extra: list[str], point: str) -> tuple[int, str, str]:
    """The tests' job on the session's Ray, its process held at the test hook `point` (a constructor, as the roles
    start: checkpoint.faults) and SIGKILLed there, then waited for: (exit status, stdout, stderr)."""
    import ray

    markers = run.parent / "markers"
    marker = markers / f"{point.replace(':', '_')}.paused"
    address = ray.get_runtime_context().gcs_address
    env = {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "LOOPLINE_PAUSE_AT": point,
        "LOOPLINE_PAUSE_DIR": str(markers),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "train", *ARGS, *RAY, f"runtime.cluster.address={address}", *extra,
         f"out_dir={run}"],
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not marker.exists() or not marker.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, f"nothing paused at {point}"
            time.sleep(0.05)
        os.kill(int(marker.read_text()), signal.SIGKILL)  # the rank's own process, in its constructor
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return proc.returncode, out, err


def test_a_rank_lost_while_the_roles_start_past_max_restarts_exits_75_in_one_line(
    ray_cluster, tmp_path: Path
) -> None:
    """runtime.max_restarts=0: the same loss gives up at once, with one line naming the rank and what to do, and
    exit status 75 (EX_TEMPFAIL), which a job controller retries (loopline k8s: the RayJob's backoffLimit)."""
    run = tmp_path / "run"
    status, out, err = _killed_while_starting(run, ["runtime.max_restarts=0"], "init:actor:1")
    assert status == 75, out[-3000:] + err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("loopline: ")]
    assert lines == [line for line in err.splitlines() if "role 'actor'" in line or "Traceback" in line]
    assert len(lines) == 1 and lines[0].startswith("loopline: role 'actor' rank 1 __init__(): "), err[-3000:]
    assert "runtime.max_restarts=0 allows no more restarts; exiting 75 (EX_TEMPFAIL)" in lines[0]
    assert not _rows(run)  # nothing trained, nothing logged: a retry with --resume starts afresh
