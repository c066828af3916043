"""Test hooks for fault injection: named points where a run can be held so a test kills it there.

LOOPLINE_PAUSE_AT holds comma-separated point names. When a run reaches one, it writes
`<LOOPLINE_PAUSE_DIR>/<name>.paused` (if that variable is set) and sleeps until it is killed, so a
test can SIGKILL it at exactly that point: mid-save, right after a save, at a given step. Points:
- `save:mid:<checkpoint>`: DCP shards written, HF weights not yet, nothing renamed (in the writer
  thread when checkpoint.async_save is on, so the loop keeps training meanwhile);
- `saved:<checkpoint>`: the checkpoint renamed into place and `latest` updated;
- `step:<phase>:<step>`: the metrics row of that step logged, before its checkpoint;
- `stage:<stage>`: at the start of a loop stage (e.g. `stage:score`), to test the watchdog;
- `policy_step:<rank>:<n>:before` / `:after` (and `sft_step:...`, `dpo_step:...`, `reward_step:...`): on trainer
  rank <rank>, around the n-th optimizer step of the phase (once per run: a rank that replaces it does not stop there again), to lose a rank mid-step;
  `send_weights:<rank>:<n>`: as that rank's part of the weight sync after its n-th step begins.
- `wait_saved:<rank>:<checkpoint>`: on trainer rank <rank>, as the checkpoint's finish waits for its shards (once per
  run), to lose a rank under a save (the last one included);
- `init:actor:<rank>` / `init:rollout:<rank>`: in the constructor of that trainer rank or engine (ray), once per run,
  to lose it while the roles start.
Ray workers get these variables from the driver (`FAULTS.env()`).
Unset (the normal case) they cost one dictionary lookup. Set, the first point reached says so on stderr
(once per process): a variable inherited by accident would otherwise hold a real run forever in silence.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

PAUSE_ENV = "LOOPLINE_PAUSE_AT"
PAUSE_DIR_ENV = "LOOPLINE_PAUSE_DIR"


class FaultPoints:
    """The run's fault-injection points, all behind this one object (`FAULTS`): production code names a point
    where it is (`FAULTS.pause_point("step:grpo:3")`), and only a test's environment makes one hold."""

    def __init__(self) -> None:
        self._warned = False  # the warning below, once per process

    def env(self) -> dict[str, str]:
        """This process's test-hook variables, for workers started elsewhere (a Ray actor gets the raylet's
        environment, not its driver's)."""
        return {k: os.environ[k] for k in (PAUSE_ENV, PAUSE_DIR_ENV) if k in os.environ}

    def pause_point(self, name: str, once: bool = False) -> None:
        """Sleep forever here when LOOPLINE_PAUSE_AT names this point (a test then kills the process). once: not
        when the point's marker is there already (a worker that replaces a killed one reaches the same point)."""
        points = os.environ.get(PAUSE_ENV)
        if not points:
            return
        if not self._warned:
            self._warned = True
            print(
                f"loopline: warning: {PAUSE_ENV}={points} is set (a test hook): this run will stop and wait "
                "forever at those points; unset it for a real run",
                file=sys.stderr,
                flush=True,
            )
        if name not in points.split(","):
            return
        marker_dir = os.environ.get(PAUSE_DIR_ENV)
        if marker_dir:
            marker = Path(marker_dir) / f"{name.replace(':', '_')}.paused"
            if once and marker.exists():
                return
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(os.getpid()))
        while True:
            time.sleep(3600)


FAULTS = FaultPoints()
