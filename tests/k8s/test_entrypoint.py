"""The rendered job's entrypoint, run as the head pod runs it: killed as a lost pod is (SIGKILL, no checkpoint of
its own), the same command again (the job's retry) continues from the last checkpoint and trains every step once.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopline.checkpoint.ledger import read_ledger, repeats
from loopline.config import load_config
from loopline.k8s.render import CONFIG_FILE, CONFIG_MOUNT, render
from loopline.metrics.logger import read_metrics
from tests.runs import pause_env

pytestmark = pytest.mark.slow

TINY = [
    "sft.steps=3", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.stop_at_accuracy=null",
    "grpo.stop_at_accuracy=null", "grpo.steps=5", "grpo.prompts_per_step=4", "grpo.group_size=2", "grpo.eval_every=0",
    "data.task.num_train=200", "data.task.num_eval=20", "eval.num_prompts=8",
    "checkpoint_every=1", "tensorboard=false", "threads=1", "deterministic=true",
]  # fmt: skip
TIMEOUT_S = 300


def _pod_command(tmp_path: Path) -> tuple[list[str], Path]:
    """The RayJob's entrypoint with the ConfigMap's file where the pod mounts it, the volume at tmp_path/runs."""
    objects = render(load_config(None, [*TINY, f"k8s.storage.mount_path={tmp_path / 'runs'}"]))
    config = tmp_path / "etc" / CONFIG_FILE
    config.parent.mkdir()
    config.write_text(objects[0]["data"][CONFIG_FILE])
    words = shlex.split(objects[-1]["spec"]["entrypoint"])
    assert words[:2] == ["loopline", "train"]
    words = [str(config) if w == f"{CONFIG_MOUNT}/{CONFIG_FILE}" else w for w in words]
    run_dir = Path(load_config(str(config)).out_dir)
    assert run_dir == tmp_path / "runs" / "loopline-default"
    return [sys.executable, "-m", "loopline.cli", *words[1:]], run_dir


def test_a_retried_job_continues_from_the_checkpoint_after_its_pod_was_killed(tmp_path):
    command, run_dir = _pod_command(tmp_path)
    proc = subprocess.Popen(
        command, env=pause_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"phase": "grpo", "step": 2' in metrics.read_text()):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no GRPO step 2 in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # the pod is gone: no handler runs, no checkpoint of its own
        proc.wait(timeout=30)
    finally:
        proc.kill()
    retry = subprocess.run(command, env=pause_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'grpo-00000'}" in retry.stdout
    grpo = [(r["step"]) for r in read_metrics(run_dir) if r["phase"] == "grpo"]
    assert grpo == [0, 1, 2, 3, 4, 5]  # rows after the checkpoint were cut back and trained again, once
    ledger = read_ledger(run_dir)
    assert [r["step"] for r in ledger if r["phase"] == "grpo"] == [1, 2, 3, 4, 5] and not repeats(ledger)
    assert (run_dir / "checkpoints" / "grpo-000005" / "state.json").is_file()
