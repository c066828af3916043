"""Feeding a sandboxed program's stdin and keeping the tails of its stdout and stderr."""

from __future__ import annotations

import contextlib
import os
import selectors
import time
from collections.abc import Callable


class Tail:
    """The last `limit` bytes of a stream, and how many bytes it carried in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[: len(self.data) - self.limit]


def pump(
    stdin_fd: int,
    stdin: bytes,
    stdout_fd: int,
    stderr_fd: int,
    deadline: float,
    limit: int,
    stalled: Callable[[float], None] | None,
) -> tuple[Tail, Tail, bool]:
    """Feed stdin and collect output tails until both outputs close or the deadline passes.

    Returns (stdout tail, stderr tail, timed out). Closes `stdin_fd` once everything is written
    (so the program sees EOF) and leaves the output fds open. `stalled(now)` is called on every
    turn, for the caller to deal with a writer that lingers.
    """
    out, err = Tail(limit), Tail(limit)
    tails = {stdout_fd: out, stderr_fd: err}
    pending = memoryview(stdin)
    sel = selectors.DefaultSelector()
    for fd in tails:
        sel.register(fd, selectors.EVENT_READ)
    if pending:
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
    else:
        os.close(stdin_fd)
    timed_out = False
    try:
        while stdout_fd in sel.get_map() or stderr_fd in sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if stalled is not None:
                stalled(now)
            for key, _ in sel.select(timeout=min(deadline - now, 0.1)):
                if key.fd in tails:
                    chunk = os.read(key.fd, 1 << 20)
                    if chunk:
                        tails[key.fd].add(chunk)
                    else:
                        sel.unregister(key.fd)
                    continue
                try:
                    pending = pending[os.write(key.fd, pending[: 1 << 16]) :]
                except BlockingIOError:
                    continue
                except BrokenPipeError:  # the program stopped reading: drop the rest
                    pending = pending[:0]
                if not pending:
                    sel.unregister(key.fd)
                    os.close(key.fd)
    finally:
        if stdin_fd in sel.get_map():
            os.close(stdin_fd)
        sel.close()
    if timed_out:
        _drain(tails)
    return out, err, timed_out


def _drain(tails: dict[int, Tail]) -> None:
    """Read what is already in the pipes, without waiting for more."""
    for fd, tail in tails.items():
        os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError, OSError):
            for _ in range(64):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                tail.add(chunk)
