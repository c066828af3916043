"""The LOOPLINE_PAUSE_AT test hook: an inherited variable makes a real run say so on stderr, once.

Without the warning a run started from a shell that still had the variable set (say, after debugging a
fault test) would stop at the named point and wait forever, silently.
"""

from __future__ import annotations

import pytest

from loopline.checkpoint import faults
from loopline.cli import main

WARNING = "loopline: warning: LOOPLINE_PAUSE_AT="


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults.FAULTS, "_warned", False)  # once per process: reset for each test
    monkeypatch.delenv(faults.PAUSE_DIR_ENV, raising=False)


def test_unset_is_silent(fresh_warning: None, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delenv(faults.PAUSE_ENV, raising=False)
    faults.FAULTS.pause_point("step:sft:1")
    assert capsys.readouterr().err == ""


def test_set_warns_once_and_passes_points_it_does_not_name(
    fresh_warning: None, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv(faults.PAUSE_ENV, "step:grpo:99,saved:sft-000004")
    for point in ("step:sft:1", "stage:score", "step:sft:2"):
        faults.FAULTS.pause_point(point)  # returns: not a named point
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1
    assert "step:grpo:99,saved:sft-000004" in err and "forever" in err


@pytest.mark.slow
def test_a_real_run_with_the_variable_inherited_warns_on_stderr(
    fresh_warning: None, monkeypatch: pytest.MonkeyPatch, capsys, tmp_path
) -> None:
    monkeypatch.setenv(faults.PAUSE_ENV, "step:sft:99")  # a point this run never reaches: it finishes
    args = ["sft.steps=2", "sft.batch_size=4", "sft.micro_batch_size=4", "sft.eval_every=0"]
    args += ["eval.num_prompts=2", "data.task.num_eval=2", "progress=false", "tensorboard=false", "threads=1"]
    assert main(["sft", *args, f"out_dir={tmp_path}"]) == 0
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1, err[-2000:]
