"""Warm sandboxes: the host side of the zygote (inside/zygote.py) that forks a child per run.

Starting bwrap and an interpreter costs tens of ms, more than most checks. A warm sandbox is one
sandboxed zygote interpreter that forks a child per run (inheriting all limits), and after each
run kills every other process of its uid, wipes the scratch dir, and reports the exit status.
Each run gets its own stdin/stdout/stderr pipes, handed over as file descriptors. On a timeout,
or anything unexpected, the whole sandbox is killed and a fresh one started for the next run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from loopline.envs.sandbox.commands import memfd, scratch_dir
from loopline.envs.sandbox.config import SANDBOX_MAIN, SANDBOX_ZYGOTE, Isolation, SandboxConfig, SandboxError
from loopline.envs.sandbox.programs import inside_source
from loopline.envs.sandbox.streams import Tail, pump
from loopline.envs.sandbox.uids import UidLease, kill_tree

logger = logging.getLogger(__name__)

# Copied into the sandbox as a file of its own (never run from the installed package, which the
# sandbox uid may not be able to read, nor from the scratch dir, which is wiped after every run).
ZYGOTE_PROGRAM = inside_source("zygote.py")


@functools.cache
def _launcher() -> ThreadPoolExecutor:
    """The thread that starts warm sandboxes (see Warm); idle, it waits for the next one."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-launcher")


class Host(Protocol):
    """What a warm sandbox needs of the Sandbox it serves (runner.Sandbox, which imports this module): its
    settings, whether it runs as root, and how it starts an interpreter under its isolation."""

    config: SandboxConfig
    isolation: Isolation
    _root: bool

    def _launch(
        self,
        main_args: list[str],
        uid: int | None,
        files: dict[str, int],
        scratch: str | None,
        pass_fds: tuple[int, ...],
        **popen: Any,
    ) -> subprocess.Popen[bytes]: ...


class WarmGone(Exception):
    """The warm sandbox died between runs (e.g. killed by the previous run); nothing ran."""


class Warm:
    """One sandboxed zygote serving runs in turn; see the module docstring."""

    def __init__(self, sandbox: Host) -> None:
        self.sandbox = sandbox
        self.runs = 0
        self.alive = True
        self._closed = False
        self._stack = contextlib.ExitStack()
        try:
            self.uid = self._stack.enter_context(UidLease()) if sandbox._root else None
            if sandbox.isolation == "bwrap":
                zygote_fd = memfd("zygote.py", ZYGOTE_PROGRAM.encode())
                self._stack.callback(os.close, zygote_fd)
                files: dict[str, int] = {SANDBOX_ZYGOTE: zygote_fd}
                pass_fds: tuple[int, ...] = (zygote_fd,)
                scratch: str | None = None
                zygote, where = SANDBOX_ZYGOTE, ["/tmp", SANDBOX_MAIN]  # (scratch, argv[0] of runs)
            else:
                files, pass_fds = {}, ()
                scratch = self._stack.enter_context(scratch_dir(self.uid))
                zygote, where = self._zygote_file(), [scratch, str(Path(scratch, "main.py"))]
            self.control, theirs = socket.socketpair()
            self._log = self._stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 - closed by the stack
            with theirs:
                # bwrap --die-with-parent and setpriv --pdeathsig fire when the *thread* that
                # started them ends: start warm sandboxes from one thread that lives as long as
                # this process, not from whichever (maybe short-lived) thread called run().
                self.proc = (
                    _launcher()
                    .submit(
                        sandbox._launch,
                        [zygote, str(theirs.fileno()), *where],
                        self.uid,
                        files,
                        scratch,
                        (theirs.fileno(), *pass_fds),
                        stdin=subprocess.DEVNULL,
                        stdout=self._log,
                        stderr=self._log,
                    )
                    .result()
                )
            if self._receive_line(time.monotonic() + 30) != "ready":
                raise SandboxError(f"the zygote did not start: {self._log_tail()}")
        except BaseException:
            self.close()
            raise

    def _zygote_file(self) -> str:
        """isolation=process: the zygote as a file the sandbox uid can read but not change."""
        folder = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="loopline-zygote-"))
        os.chmod(folder, 0o755)
        path = Path(folder, "zygote.py")
        path.write_text(ZYGOTE_PROGRAM)
        path.chmod(0o444)
        return str(path)

    def run(self, code: str, stdin: bytes) -> tuple[int, bool, Tail, Tail]:
        cfg = self.sandbox.config
        deadline = time.monotonic() + cfg.timeout_s
        self.runs += 1
        program = memfd("main.py", code.encode())
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        try:
            socket.send_fds(self.control, [b"r"], [program, stdin_r, stdout_w, stderr_w])
        except OSError as e:
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            self.close()
            raise WarmGone(str(e)) from e
        finally:
            for fd in (program, stdin_r, stdout_w, stderr_w):
                os.close(fd)
        try:
            # The outputs close when the run and everything it started are dead (the zygote
            # kills leftovers before it reports), or when the whole sandbox is killed.
            out, err, timed_out = pump(
                stdin_w, stdin, stdout_r, stderr_r, deadline, cfg.max_output_bytes, None
            )
        finally:
            os.close(stdout_r)
            os.close(stderr_r)
        if timed_out:
            self.close()
            return -signal.SIGKILL, True, out, err
        report = self._receive_line(deadline) if self.alive else ""
        try:
            code_, clean = (int(x) for x in report.split())
        except ValueError:
            logger.warning("warm sandbox died during a run (report %r); replacing it", report)
            self.close()
            err.add(b"\n[sandbox: the sandbox process was killed during this run]\n")
            return -signal.SIGKILL, False, out, err
        if not clean:
            logger.warning("warm sandbox could not be cleaned after a run; replacing it")
            self.close()
        return code_, False, out, err

    def _receive_line(self, deadline: float) -> str:
        """One line from the zygote, or "" if it is gone or silent past the deadline."""
        data = b""
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return ""
            self.control.settimeout(remaining)
            try:
                chunk = self.control.recv(64)
            except (TimeoutError, OSError):
                return ""
            if not chunk:
                return ""
            data += chunk
        return data.decode(errors="replace").strip()

    def _log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-2000:].decode(errors="replace").strip()

    def close(self) -> None:
        """Kill the sandbox and release its uid (once: after that the uid may be someone else's)."""
        if self._closed:
            return
        self._closed, self.alive = True, False
        with contextlib.suppress(AttributeError, OSError):
            self.control.close()
        if hasattr(self, "proc"):
            kill_tree(self.proc, self.uid, self.sandbox.isolation)
        self._stack.close()
