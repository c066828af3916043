"""This process's memory as the kernel counts it (/proc/self/status), for the benchmarks that report peaks."""

from __future__ import annotations

import contextlib
from pathlib import Path


def status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes (0 when absent): VmRSS, resident now; VmHWM, the peak resident set
    (since the last reset_peak); VmPeak, peak virtual memory (what RLIMIT_AS limits). Not ru_maxrss for a peak: a
    process started by fork or vfork then exec carries its parent's high-water mark in it, so a small run under a
    large parent would report the parent's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> int:
    """Reset the peak resident set (VmHWM) to the current one; return that, in bytes. Where /proc/self/clear_refs
    cannot be written, VmHWM stays the lifetime peak."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")
