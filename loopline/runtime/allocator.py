"""The C allocator's settings for a process that holds a model (no torch here: a light import)."""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def return_freed_memory(kib: int) -> bool:
    """glibc: blocks of at least `kib` KiB mapped on their own, so a freed tensor's memory leaves the process
    (malloc_mmap_threshold_kib); 0, or a C library without mallopt: unchanged. True if set."""
    if not kib or not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # musl has none
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, kib * 1024))
