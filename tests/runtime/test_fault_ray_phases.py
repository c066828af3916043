"""`loopline sft`, `dpo` and `rm` on the ray backend survive a lost trainer rank as `train` does (runtime.supervisor).

Each command runs in a process of its own that joins the session's Ray (tests/conftest.py) by address: 2 FSDP2
trainer ranks, 1 engine, 1 env worker, deterministic, a checkpoint every 2 steps. Trainer rank 1 is held at the
test hook before the phase's 3rd optimizer step (`<method>:1:3:before`, loopline.checkpoint.faults) and SIGKILLed
there: the run must restart its trainer group from the checkpoint of step 2, train step 3 again, and end with the
weights of the same run never interrupted, bit for bit, every step logged once. Past runtime.max_restarts the
same loss ends the run with one line and exit 75 (EX_TEMPFAIL), never a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.metrics.logger import read_metrics
from tests.runs import pause_env

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TINY = [
    "sft.batch_size=4", "sft.micro_batch_size=2", "sft.eval_every=0", "data.task.num_train=20",
    "data.task.num_eval=4", "eval.num_prompts=4", "preference.num_train=8", "preference.num_eval=4",
    "checkpoint_every=2", "progress=false", "tensorboard=false", "threads=1", "deterministic=true",
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
]  # fmt: skip
RAY = [
    "runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.engines=1", "runtime.env_workers=1",
    "runtime.call_timeout_s=120", "runtime.trainer_warm=false",
    "checkpoint.async_save=false",  # step 2's checkpoint whole before step 3 starts: the one a restart loads
]  # fmt: skip
# each command: its own settings, the test hook where rank 1 is lost (the phase's 3rd step), what it writes
COMMANDS = {
    "sft": (["sft.steps=4"], "sft_step:1:3:before", "model/model.safetensors"),
    "dpo": (
        ["sft.steps=1", "dpo.steps=4", "dpo.batch_size=4", "dpo.micro_batch_size=2", "dpo.eval_every=0"],
        "dpo_step:1:3:before",
        "model/model.safetensors",
    ),
    "rm": (
        ["sft.steps=1", "rm.steps=4", "rm.batch_size=4", "rm.micro_batch_size=2", "rm.eval_every=0"],
        "reward_step:1:3:before",
        "reward_model/model.safetensors",
    ),
}
RUN_TIMEOUT_S = 400


def _run(command: str, run: Path, extra: list[str], point: str | None = None) -> tuple[int, str, str]:
    """`loopline <command>` on the session's Ray; with `point`, the process that reaches that test hook is
    SIGKILLed there (once). (exit status, stdout, stderr)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    markers = run.parent / "markers"
    env = {**pause_env(point, markers), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    settings = COMMANDS[command][0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", command, *TINY, *settings, *RAY, f"runtime.cluster.address={address}",
         *extra, f"out_dir={run}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        if point is not None:
            marker = markers / f"{point.replace(':', '_')}.paused"
            while not marker.exists() or not marker.read_text():
                if proc.poll() is not None:
                    out, err = proc.communicate()
                    raise AssertionError(
                        f"run exited {proc.returncode} before {point}:\n{out[-2000:]}{err[-3000:]}"
                    )
                assert time.monotonic() < deadline, f"no rank paused at {point}"
                time.sleep(0.05)
            os.kill(int(marker.read_text()), signal.SIGKILL)  # the rank's own process, before its step
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return proc.returncode, out, err


def _steps(run: Path) -> list[tuple[str, int]]:
    return [(r["phase"], r["step"]) for r in read_metrics(run)]


@pytest.mark.parametrize(
    "command",
    ["sft", pytest.param("dpo", marks=pytest.mark.heavy), pytest.param("rm", marks=pytest.mark.heavy)],
)
def test_a_trainer_rank_killed_mid_run_restarts_and_ends_bitwise_as_the_uninterrupted_run(
    ray_cluster, tmp_path: Path, command: str
) -> None:
    """Rank 1 lost before the phase's 3rd step: the trainer group alone restarts from the checkpoint of step 2
    (restart 1 of 1), the time to recover is printed and logged, and the run ends as the one never interrupted:
    its output weights bit for bit, every metrics row once (step 3's, trained twice, logged once), every SFT
    sample once (the ledger)."""
    _, point, output = COMMANDS[command]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    status, out, err = _run(command, whole, [])
    assert status == 0, out[-3000:] + err[-3000:]
    status, out, err = _run(command, killed, ["runtime.max_restarts=1"], point)
    assert status == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "role 'actor' rank" in out  # the failure, named
    assert "restarted the trainer group; resuming from the last checkpoint (restart 1 of 1" in out, out[
        -3000:
    ]
    assert "recovered in " in out
    phase = "sft" if command == "sft" else command
    assert f"resumed from {killed / 'checkpoints' / f'{phase}-000002'}" in out, out[-3000:]
    assert _steps(killed) == _steps(whole)  # each once, in order
    assert len(set(_steps(killed))) == len(_steps(killed))
    assert any("recover_actor_s" in r for r in read_metrics(killed))
    assert not repeats(read_ledger(killed))
    assert (killed / output).read_bytes() == (whole / output).read_bytes()


def test_a_trainer_rank_lost_past_max_restarts_exits_75_in_one_line(ray_cluster, tmp_path: Path) -> None:
    """runtime.max_restarts=0: `loopline sft` gives up at the lost rank with one line naming it and the command
    that continues the run, exit status 75 (EX_TEMPFAIL, which a job controller retries), no traceback; the
    run resumes from its last checkpoint as that line says."""
    run = tmp_path / "run"
    status, out, err = _run("sft", run, ["runtime.max_restarts=0"], COMMANDS["sft"][1])
    assert status == 75, out[-3000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    hook = "loopline: warning: LOOPLINE_PAUSE_AT="  # the test hook's own warning, not the run's account
    lines = [line for line in err.splitlines() if line.startswith("loopline: ") and not line.startswith(hook)]
    assert len(lines) == 1 and lines[0].startswith("loopline: role 'actor' rank "), err[-3000:]
    assert "runtime.max_restarts=0 allows no more restarts; exiting 75 (EX_TEMPFAIL)" in lines[0]
    assert f"continue with `loopline sft --resume out_dir={run}`" in lines[0]
    assert _steps(run)[-1] == ("sft", 2)
    assert (run / "checkpoints" / "latest").read_text().strip() == "sft-000002"


@pytest.mark.heavy
@pytest.mark.parametrize("command", ["sft", "dpo", "rm"])
def test_with_two_replicas_a_killed_rank_heals_or_restarts_and_ends_bitwise(
    ray_cluster, tmp_path: Path, command: str
) -> None:
    """runtime.trainer_replicas=2 (each of the 2 ranks a whole copy), rank 1 lost before the phase's 3rd step: SFT
    and DPO heal the trainer from the live replica (no checkpoint loaded, no step trained again); the reward model
    is not in a replica's state, so `rm` restarts its trainer group from the checkpoint of step 2 instead. Each
    ends bitwise as the same run never interrupted, every row once."""
    _, point, output = COMMANDS[command]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    replicas = ["runtime.trainer_replicas=2"]
    status, out, err = _run(command, whole, replicas)
    assert status == 0, out[-3000:] + err[-3000:]
    status, out, err = _run(command, killed, [*replicas, "runtime.max_restarts=1"], point)
    assert status == 0, out[-3000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    if command == "rm":
        assert "restarted the trainer group; resuming from the last checkpoint (restart 1 of 1" in out, out[
            -3000:
        ]
    else:
        assert "healed the trainer from a live replica" in out, out[-3000:]
        assert "resuming from the last checkpoint" not in out and "recovered in " not in out
    assert _steps(killed) == _steps(whole)  # each once, in order
    assert not repeats(read_ledger(killed))
    assert (killed / output).read_bytes() == (whole / output).read_bytes()
