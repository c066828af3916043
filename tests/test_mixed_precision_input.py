"""Bad input for mixed precision: each one line naming the field, exit 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.config import ConfigError, load_config


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["model.dtype=bfloat16"], "model.dtype"),
        (["runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.trainer_tp=2"], "runtime.trainer_tp"),
        (["runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.trainer_pp=2"], "runtime.trainer_pp"),
        (["grpo.advantage=gae"], "grpo.advantage"),
    ],
)
def test_mixed_precision_refuses_what_it_does_not_cover(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as caught:
        load_config(None, ["training.mixed_precision=bf16", *overrides])
    assert "training.mixed_precision" in str(caught.value) and "\n" not in str(caught.value)
    load_config(None, overrides)  # alone, each is fine


def _cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    code = "import sys; from loopline.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )  # fmt: skip


@pytest.mark.parametrize("field", ["training.mixed_precision=bf16", "rollout.dtype=bfloat16"])
def test_bf16_on_a_machine_without_bf16_support_is_refused(tmp_path: Path, field: str) -> None:
    """ATEN_CPU_CAPABILITY=default makes torch run scalar kernels only (no vectorised bf16 path): the run is refused
    before anything starts or is written."""
    out = tmp_path / "run"
    done = _cli(["train", field, f"out_dir={out}"], tmp_path, ATEN_CPU_CAPABILITY="default")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0] and "bf16 support" in lines[0], done.stderr
    assert not out.exists()


def test_mixed_precision_is_refused_for_the_reward_model(tmp_path: Path) -> None:
    out = tmp_path / "rm"
    done = _cli(["rm", "training.mixed_precision=bf16", f"out_dir={out}"], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "training.mixed_precision" in lines[0], done.stderr
    assert not out.exists()
