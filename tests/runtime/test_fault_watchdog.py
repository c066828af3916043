"""A stage that hangs fails the run within a bounded time, naming the stage, role and rank.

`loopline train` runs with runtime.stage_timeout_s=3; the LOOPLINE_PAUSE_AT test hook makes the first
GRPO `score` stage hang (the process sleeps inside it, as on a wedged verifier). The watchdog must end
the process with status 3 within a few seconds of the limit, say which stage of which role and rank is
stuck, dump the threads' stacks, and leave the newest whole checkpoint as it was.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopline.runtime.watchdog import EXIT_STUCK

pytestmark = pytest.mark.slow

LIMIT_S = 3.0
ARGS = [
    "sft.steps=1", "sft.batch_size=4", "sft.micro_batch_size=4", "sft.eval_every=0", "grpo.steps=2",
    "grpo.prompts_per_step=2", "grpo.group_size=2", "data.task.num_train=20", "data.task.num_eval=4",
    "eval.num_prompts=4", "progress=false", "tensorboard=false", "threads=1", f"runtime.stage_timeout_s={LIMIT_S}",
]  # fmt: skip


def test_a_stuck_stage_ends_the_run_naming_stage_role_and_rank(tmp_path: Path) -> None:
    run, markers = tmp_path / "run", tmp_path / "markers"
    env = {**os.environ, "LOOPLINE_PAUSE_AT": "stage:score", "LOOPLINE_PAUSE_DIR": str(markers)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopline.cli", "train", *ARGS, f"out_dir={run}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (markers / "stage_score.paused").exists():
            assert proc.poll() is None, f"run ended (rc {proc.returncode}) before the score stage"
            assert time.monotonic() < deadline, "run did not reach the score stage"
            time.sleep(0.05)
        stuck_at = time.monotonic()
        _, err = proc.communicate(timeout=LIMIT_S + 30)
        took = time.monotonic() - stuck_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == EXIT_STUCK, err[-3000:]
    # it waited the limit, and the watchdog ended it (its exit code), not communicate's timeout
    assert took >= LIMIT_S
    assert "watchdog: stage 'score' of role 'env' (rank 0) is stuck" in err
    assert "pause_point" in err  # the stacks show where the stuck thread is
    assert (run / "checkpoints" / "latest").read_text().strip() == "sft-000001"
