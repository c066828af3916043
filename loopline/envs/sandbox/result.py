"""What one sandboxed run did, as handed back to callers."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from loopline.envs.sandbox.config import Isolation


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did; output fields hold the last `max_output_bytes` of each stream."""

    # Process exit status; negative = killed by that signal (-9 on timeout). Fresh bwrap runs
    # report statuses above 128 the shell's way, so exit(137) reads as SIGKILL there.
    exit_code: int
    timed_out: bool  # the wall-clock limit was hit and the run was killed
    stdout: str  # tail, decoded as UTF-8 with replacement
    stderr: str
    stdout_bytes: int  # total bytes written, including what was dropped
    stderr_bytes: int
    duration_s: float
    isolation: Isolation

    @property
    def output_truncated(self) -> bool:
        """Whether either stream lost its head to the output limit."""
        return len(self.stdout.encode()) < self.stdout_bytes or len(self.stderr.encode()) < self.stderr_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (for JSON output)."""
        return asdict(self)
