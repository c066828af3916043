"""Helpers for tests that run `loopline` as a process of its own: hold it at a pause point and SIGKILL it there,
and compare metrics rows without their wall-clock fields."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple


def pause_env(point: str | None = None, markers: Path | None = None) -> dict[str, str]:
    """This environment less any inherited LOOPLINE_PAUSE_*; with `point`, the run holds there
    (loopline.checkpoint.faults) and writes its marker into `markers`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_PAUSE")}
    if point:
        env.update(LOOPLINE_PAUSE_AT=point, LOOPLINE_PAUSE_DIR=str(markers))
    return env


def kill_at(cmd: list[str], point: str, markers: Path, timeout_s: float) -> None:
    """Start `cmd` (a `loopline` run), wait until it is held at `point`, SIGKILL it."""
    marker = markers / f"{point.replace(':', '_')}.paused"
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen(
        cmd, env=pause_env(point, markers), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(
                    f"run ended (rc {proc.returncode}) before {point}: {proc.stderr.read()[-3000:]}"
                )
            assert time.monotonic() < deadline, f"run did not reach {point} within {timeout_s:g}s"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def steady(rows: list[dict]) -> list[dict]:
    """Metrics rows without wall-clock measurements (those differ between any two runs)."""
    return [
        {
            k: v
            for k, v in r.items()
            if not k.startswith("time_") and not k.endswith(("tokens_per_s", "_idle_fraction"))
        }
        for r in rows
    ]


class KillBeforeCall:
    """The scorer, with an env worker SIGKILLed from outside just before its n-th call of `method` (`score` for a
    single-turn env, `step` for a multi-turn one): mid-rollout, while the step is in flight."""

    def __init__(self, scorer, n: int, method: str = "step") -> None:
        self._scorer, self._n, self._method, self._calls = scorer, n, method, 0

    def __getattr__(self, name: str):
        call = getattr(self._scorer, name)
        if name != self._method:
            return call

        def counted(*args, **kwargs):
            self._calls += 1
            if self._calls == self._n:
                os.kill(next(w.pid for w in self._scorer.pool.workers() if w.pid is not None), signal.SIGKILL)
            return call(*args, **kwargs)

        return counted


class Scored(NamedTuple):
    """A verdict as the scorer reads it (loopline.envs.episodes.Verdict's fields), standard library only."""

    reward: float
    correct: bool


def die_once_chunk(markers: str, chunk: tuple[list[str], list[object]]) -> list[Scored]:
    """An env worker's chunk scorer (loopline.runtime.scorer, fn=): each text's number as its score. The chunk
    holding text "0" SIGKILLs its own worker the first time, once the chunk holding "3" has been scored, so that
    the retried chunk finishes after a later one. Standard library only: spawned workers import this file."""
    texts = chunk[0]
    done, died = Path(markers, "3-scored"), Path(markers, "0-died")
    if "0" in texts and not died.exists():
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        died.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    if "3" in texts:
        done.touch()
    return [Scored(float(t), int(t) % 2 == 0) for t in texts]
