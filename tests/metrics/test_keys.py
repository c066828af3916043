"""Every key a real run writes to metrics.jsonl is declared in loopline.metrics.keys (whose table the metrics
reference page is generated from): a short `loopline train` through the CLI, with the KL term and the behaviour
correction on so that their keys are written too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loopline.metrics.keys import METRICS, declared
from loopline.metrics.logger import read_metrics

pytestmark = pytest.mark.e2e

TINY = [
    "sft.steps=3", "sft.stop_at_accuracy=0.99", "sft.batch_size=8", "sft.micro_batch_size=8",
    "grpo.steps=2", "grpo.stop_at_accuracy=0.99", "grpo.prompts_per_step=4", "grpo.group_size=4",
    "grpo.kl_coef=0.05", "grpo.behaviour_correction=tis",
    "eval.num_prompts=8", "data.task.num_val=8", "sft.check_every=2", "grpo.check_every=1",
    "progress=false", "tensorboard=false",
]  # fmt: skip


def test_every_key_a_train_run_writes_is_declared(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "train", f"out_dir={out}", *TINY],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out)
    written = {key for row in rows for key in row}
    assert {
        "phase",
        "step",
        "loss",
        "eval_accuracy",
        "reward_mean",
        "measured_kl",
        "behaviour_weight_mean",
    } <= written
    assert "val_accuracy" in written  # the stop checks ran on the validation split
    undeclared = sorted(k for k in written if declared(k) is None)
    assert not undeclared, f"metrics keys written but not declared in loopline/metrics/keys.py: {undeclared}"


def test_patterns_match_only_their_family() -> None:
    assert declared("staleness_2") == "staleness_<v>"
    assert declared("recover_rollout_s") == "recover_<role>_s"
    assert declared("loss") == "loss"
    assert declared("lossy") is None and declared("staleness_") is None
    assert all(text.strip() for text in METRICS.values())
