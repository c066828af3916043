"""Every benchmark refuses counts and sizes that are not positive, and unknown names, with a usage error naming the
option, before any work (several once ran on: a division by zero, a median of nothing, a wait for a checkpoint
that never comes)."""

from __future__ import annotations

import pytest

from loopline.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sandbox", "--limit", "0"], "--limit must be at least 1 (got 0)"),
        (["sandbox", "--workers", "0"], "--workers must be at least 1"),
        (["sandbox", "--repeats", "0"], "--repeats must be at least 1"),
        (["sync", "--trainer", "0"], "--trainer must be at least 1"),
        (["sync", "--engines", "-1"], "--engines must be at least 1 (got -1)"),
        (["sync", "--repeats", "0"], "--repeats must be at least 1"),
        (["sync", "--bucket-mb", "0"], "--bucket-mb must be > 0 (got 0.0)"),
        (["sync", "--bucket-mb", "nan"], "--bucket-mb must be > 0 (got nan)"),
        (["restart", "--repeats", "0"], "--repeats must be at least 1"),
        (["restart", "--resume-step", "-1"], "--resume-step must be at least 1"),
        (["restart", "--kill-step", "0"], "--kill-step must be at least 1"),
        (["restart", "--models", "builtin,nope"], "unknown ['nope']"),
        (["restart", "--restart-model", "huge"], "unknown ['huge']"),
        (["async", "--seeds", "0,x"], "--seeds must be a comma list of integers (got '0,x')"),
        (["async", "--timeout", "0"], "--timeout must be > 0"),
        (["generate", "--threads", "0"], "--threads must be at least 1"),
        (["pack", "--micro-batch", "0"], "--micro-batch must be at least 1"),
        (["pp", "--heads", "0"], "--heads must be at least 1"),
        (["memory", "--rows", "0"], "--rows must be at least 1 (got 0)"),
        (["memory", "--limit-gib", "0"], "--limit-gib must be > 0"),
        (["memory", "--lengths", "256,x"], "a comma list of integers (got '256,x')"),
        (["memory", "--lengths", "0"], "lengths must be at least 1"),
        (["memory", "--backends", "local,gpu"], "--backends must be a comma list of local, ray"),
        (["memory", "--preset", "qwen9"], "invalid choice: 'qwen9'"),
        (["generate", "--dtype", "float16"], "invalid choice: 'float16'"),
    ],
)
def test_bad_sizes_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.unit
def test_shared_helpers_are_not_benchmarks(capsys):
    """`args` holds the benchmarks' shared checks: `loopline bench args` is refused, not run (it has no main)."""
    assert main(["bench", "args"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'args'" in err and "memory" in err and "args," not in err, err
