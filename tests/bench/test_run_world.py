"""`run_world`: ranks fork from a preloaded server yet see the caller's environment as it is at each call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loopline.bench.sync import run_world

pytestmark = pytest.mark.gloo


def _write_env(rank: int, world: int, out: str) -> None:
    Path(out, f"{rank}.txt").write_text(os.environ.get("LOOPLINE_WORLD_MARK", "unset"))


def test_ranks_see_the_callers_environment_of_each_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    monkeypatch.delenv("LOOPLINE_WORLD_MARK", raising=False)
    run_world(_write_env, 2, args=(str(first),), timeout_s=120)  # starts the fork server (if none yet)
    monkeypatch.setenv("LOOPLINE_WORLD_MARK", "set after the server started")
    run_world(_write_env, 2, args=(str(second),), timeout_s=120)
    assert [(first / f"{r}.txt").read_text() for r in range(2)] == ["unset"] * 2
    assert [(second / f"{r}.txt").read_text() for r in range(2)] == ["set after the server started"] * 2
