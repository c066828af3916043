"""`loopline bench restart` end to end on the built-in model, save part only (the restart part starts
several `loopline train` processes; tests/loops/test_resume_exact.py covers those runs). Every wait in
the save bench is bounded by checkpoint.save_timeout_s."""

from __future__ import annotations

import pytest

from loopline.cli import main


def test_bench_restart_save_part_prints_its_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "restart", "--skip-restart", "--models", "builtin", "--repeats", "1"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    for key in ("blocking.loop_blocked_s", "async.loop_blocked_s", "async.until_latest_s", "train_step_s"):
        assert float(lines[f"save.builtin.{key}"]) > 0, key
    assert int(lines["save.builtin.checkpoint_bytes"]) > 0
    assert list(lines)[-1] == "headline.async_over_blocking_loop_blocked"
    assert float(lines["headline.async_over_blocking_loop_blocked"]) > 0
