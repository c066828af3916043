"""SIGINT and SIGTERM during a run: stop where a step ends, with a checkpoint, instead of losing the step
(Ctrl-C) or everything since the last periodic save (a preempted pod: Kubernetes, Kueue and spot nodes send
SIGTERM, then SIGKILL after a grace period).

The first signal sets a flag; the loops read it where a step ends (its metrics row logged), save a checkpoint
there and raise Interrupted. The command then prints the checkpoint and exits with 128 + the signal's number
(130 for SIGINT, 143 for SIGTERM: what a shell reports for a process the signal killed). A second signal
exits at once, without a checkpoint: the newest whole checkpoint is still there, as after any kill.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from loopline.checkpoint.state import RunState

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A run stopped by a signal at a step's end, after writing the checkpoint of `state`."""

    def __init__(self, signum: int, state: RunState) -> None:
        self.signum, self.state = signum, state
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} after {state.phase} step {state.step}")


class StopFlag:
    """Set by the first SIGINT/SIGTERM while handling() is on; the loops check it at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self, state: RunState) -> None:
        """At a step's end, after its checkpoint: raise Interrupted if a signal came."""
        if self.signum is not None:
            raise Interrupted(self.signum, state)

    @contextmanager
    def handling(self) -> Iterator[StopFlag]:
        """Catch SIGINT and SIGTERM while the block runs (main thread only; a SIGINT the process was started to
        ignore stays ignored, as Python leaves it)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in SIGNALS}
        for s in SIGNALS:
            if previous[s] is not signal.SIG_IGN:
                signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(
                f"\nloopline: second {name}: exiting now, without a checkpoint", file=sys.stderr, flush=True
            )
            sys.stdout.flush()
            os._exit(128 + signum)
        self.signum = signum
        print(
            f"\nloopline: {name}: finishing this step, then saving a checkpoint and exiting "
            f"({name} again exits at once)",
            file=sys.stderr,
            flush=True,
        )
