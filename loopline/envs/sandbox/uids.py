"""Sandbox uids (host root only): leasing one per sandbox, finding and killing its processes.

When the host runs as root, the code runs under a uid of its own, leased per sandbox process
(`UidLease`): RLIMIT_NPROC only bites for non-root uids, a non-root uid cannot signal or read
the host's processes, and "every process of this uid" is exactly the sandbox, which is how
leftovers are found and killed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from loopline.envs.sandbox.config import UID_BASE, UID_COUNT, Isolation, SandboxError

logger = logging.getLogger(__name__)


def setpriv_argv(uid: int) -> list[str]:
    """Drop to `uid` with no groups, no capabilities and no way to regain privileges."""
    return [
        shutil.which("setpriv") or "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


class UidLease:
    """Exclusive use of one sandbox uid, across processes, via an flock on a file per uid.

    The kernel drops the lock when its holder dies, so a crashed host never leaks a uid; a new
    holder first kills whatever the old one may have left under it.
    """

    def __init__(self) -> None:
        self.fd = -1

    def __enter__(self) -> int:
        lock_dir = Path(tempfile.gettempdir(), "loopline-sandbox-uids")
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        st = lock_dir.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SandboxError(f"{lock_dir} must be owned by uid {os.geteuid()} with mode 0700")
        start = random.randrange(UID_COUNT)  # spread concurrent hosts over the range
        for i in range(UID_COUNT):
            uid = UID_BASE + (start + i) % UID_COUNT
            fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    continue
                raise
            self.fd = fd
            if not kill_uid(uid):
                self.__exit__()
                raise SandboxError(
                    f"cannot clear leftover processes of sandbox uid {uid}: {pids_of_uid(uid)}"
                )
            return uid
        raise SandboxError(f"all {UID_COUNT} sandbox uids are in use")

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing releases the flock


def pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid` (sandbox leftovers, when uid is a sandbox's).

    Reads /proc/<pid>/status: the owner of /proc/<pid> is root for non-dumpable processes,
    which any process can make itself. The zygote has its own copy (inside/zygote.py), which it
    cannot import from here.
    """
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read(4096)
        except OSError:
            continue
        state = status.find(b"\nState:")
        real = status.find(b"\nUid:")
        if state < 0 or real < 0 or status[state + 7 :].split()[0] == b"Z":
            continue
        if int(status[real + 5 :].split()[0]) == uid:
            found.append(int(name))
    return found


def tasks_of_uid(uid: int) -> int:
    """Tasks (processes and threads) of `uid`: what RLIMIT_NPROC counts."""
    total = 0
    for pid in pids_of_uid(uid):
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/task"))
    return total


def kill_uid(uid: int, wait_s: float = 5.0) -> bool:
    """SIGKILL every process of a sandbox uid; True once none is left (waits up to wait_s).

    kill(-1) sent from that uid reaches all its processes in one sweep, atomically against fork,
    so neither a fork bomb nor a process that keeps moving to a new pid can outrun it. It is sent
    before looking: a /proc scan lists the pids, then reads each, and can miss a process that
    forked and exited in between. The wait covers processes still being torn down by the kernel.
    """
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while True:
        subprocess.run(
            [*setpriv_argv(uid), shutil.which("kill") or "kill", "-KILL", "-1"], capture_output=True
        )
        if not pids_of_uid(uid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _session_members(sid: int) -> list[int]:
    """Processes whose session id is `sid` (children keep it unless they call setsid)."""
    found = []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[3]) == sid:
                found.append(int(name))
    return found


def kill_tree(proc: subprocess.Popen[bytes], uid: int | None, isolation: Isolation) -> None:
    """Kill a sandbox and whatever it left behind.

    bwrap: killing its monitor kills the PID namespace's init (--die-with-parent), which takes
    every process in the namespace with it. Then every process of the uid; without a uid of
    its own (process isolation, not root), every process still in the session.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()
    if uid is not None:  # (for bwrap this waits out the namespace's teardown)
        if not kill_uid(uid):
            logger.error("sandbox uid %d still has processes %s after SIGKILL", uid, pids_of_uid(uid))
    elif isolation == "process":
        for pid in _session_members(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
