"""Run untrusted, model-written Python under OS isolation and hard resource limits.

Two isolation levels, chosen by `SandboxConfig.isolation`:

- "bwrap": bubblewrap. No network (own net namespace), own PID/IPC/UTS namespaces, an empty
  root with only /usr (plus /bin, /lib symlinks) and the interpreter's install bound read-only,
  a fresh /proc and /dev, a size-capped private tmpfs on /tmp as the scratch dir, a cleared
  environment, --die-with-parent and --new-session.
- "process": a plain subprocess with the same rlimits and a scratch dir in the host's temp dir.
  The code sees the host file system and network: a loud warning is logged.

In both, when the host runs as root the code runs under a uid of its own, leased for the run
(see `_UidLease`): RLIMIT_NPROC only bites for non-root uids, a non-root uid cannot signal or
read the host's processes, and "every process of this uid" is exactly the sandbox, which is how
leftovers are found and killed. Limits are set by `prlimit` before the interpreter starts, so
they cover the whole process tree; the wall-clock limit is enforced from outside by killing the
session (and, for bwrap, the PID namespace dies with its init).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from loopline.config import Section

logger = logging.getLogger(__name__)

Isolation = Literal["bwrap", "process"]

# Sandbox uids are leased from this range (host root only). Far above normal user and
# container uids, so no host file or process belongs to them.
UID_BASE = 1_000_000
UID_COUNT = 4096
# Where the code file appears inside bwrap.
SANDBOX_MAIN = "/sandbox/main.py"


class SandboxConfig(Section):
    """How untrusted code is isolated and limited."""

    isolation: Literal["auto", "bwrap", "process"] = Field(
        "auto", description="bwrap (namespaces), process (rlimits only, weak), or auto: bwrap if it works."
    )
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit; the whole process tree is killed.")
    cpu_s: int = Field(10, gt=0, description="CPU-seconds limit per process (RLIMIT_CPU).")
    memory_mb: int = Field(1024, gt=0, description="Address-space limit per process (RLIMIT_AS), MiB.")
    max_procs: int = Field(16, gt=0, description="Processes and threads the code may have (RLIMIT_NPROC).")
    max_file_mb: int = Field(16, gt=0, description="Largest file the code may write (RLIMIT_FSIZE), MiB.")
    scratch_mb: int = Field(64, gt=0, description="Size of the private /tmp scratch tmpfs (bwrap), MiB.")
    max_output_bytes: int = Field(
        65536, gt=0, description="Bytes kept of stdout and of stderr each; the tail is kept."
    )
    python: str = Field(
        "", description="Interpreter inside the sandbox; empty = the base install running loopline."
    )
    site_packages: bool = Field(
        False, description="Let the code import the interpreter's site-packages (site.py runs: slower start)."
    )
    ro_binds: list[str] = Field(
        default_factory=list, description="Extra host paths bound read-only into bwrap (e.g. a venv)."
    )


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did; output fields hold the last `max_output_bytes` of each stream."""

    exit_code: int  # process exit status; negative = killed by that signal (-9 on timeout)
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


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not an error of the code it runs)."""


# ---------------------------------------------------------------------------------------------
# Sandbox
# ---------------------------------------------------------------------------------------------


class Sandbox:
    """Runs Python source under the configured isolation; safe to share between threads."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.python = resolve_python(self.config.python)
        # -I: ignore PYTHON* variables and the user site; -S: no site.py, so no .pth file runs
        # code at start-up and the interpreter starts several times faster.
        self.python_flags = ["-I"] if self.config.site_packages else ["-I", "-S"]
        self._root = os.geteuid() == 0
        for tool in ("prlimit", "setpriv"):
            if shutil.which(tool) is None:
                raise SandboxError(f"'{tool}' (util-linux) is required by the sandbox and was not found")
        self.isolation: Isolation = self._choose_isolation()
        if self.isolation == "process":
            if self._root and not readable_by_others(self.python):
                raise SandboxError(
                    f"process isolation as root drops to an unprivileged uid, which cannot run "
                    f"{self.python} (a parent directory is not world-readable); set sandbox.python to "
                    f"a world-readable interpreter such as /usr/bin/python3, or install bubblewrap"
                )
            logger.warning(
                "SANDBOX ISOLATION IS WEAK (isolation=process): untrusted code runs as a plain "
                "subprocess with rlimits only; it can read host files and use the network%s. "
                "Install bubblewrap for real isolation.",
                "" if self._root else ", and runs as your own user",
            )
        else:
            logger.info("sandbox isolation: bwrap (python %s)", self.python)

    def _choose_isolation(self) -> Isolation:
        wanted = self.config.isolation
        if wanted == "process":
            return "process"
        problem = bwrap_problem(self.python, tuple(self.config.ro_binds), self._root)
        if problem is None:
            return "bwrap"
        if wanted == "bwrap":
            raise SandboxError(f"isolation=bwrap requested but bubblewrap does not work here: {problem}")
        logger.warning("bubblewrap does not work here (%s); falling back to isolation=process", problem)
        return "process"

    def run(self, code: str, stdin: bytes = b"") -> SandboxResult:
        """Run `code` as a Python program (argv[0] = its file), feeding it `stdin`."""
        cfg = self.config
        with contextlib.ExitStack() as stack:
            uid = stack.enter_context(_UidLease()) if self._root else None
            if uid is not None and not _kill_uid(uid):  # a crashed host may have left processes behind
                raise SandboxError(
                    f"cannot clear leftover processes of sandbox uid {uid}: {pids_of_uid(uid)}"
                )
            if self.isolation == "bwrap":
                code_fd = _memfd("main.py", code.encode())
                stack.callback(os.close, code_fd)
                argv = _bwrap_argv(cfg, self.python, uid, code_fd) + _limits_argv(cfg, uid)
                argv += [self.python, *self.python_flags, SANDBOX_MAIN]
                cwd, pass_fds = "/", (code_fd,)
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            else:
                scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="loopline-sandbox-"))
                main = Path(scratch, "main.py")
                main.write_text(code)
                main.chmod(0o444)
                if uid is not None:
                    os.chown(scratch, uid, uid)
                argv = _process_prefix(uid) + _limits_argv(cfg, uid)
                argv += [self.python, *self.python_flags, str(main)]
                cwd, pass_fds = scratch, ()
                env = {
                    "PATH": "/usr/local/bin:/usr/bin:/bin",
                    "HOME": scratch,
                    "TMPDIR": scratch,
                    "LANG": "C.UTF-8",
                }
            start = time.monotonic()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                cwd=cwd,
                env=env,
                start_new_session=True,  # the run is its own session: killpg reaches the whole tree
            )
            try:
                out, err, timed_out = _communicate(
                    proc, stdin, start + cfg.timeout_s, cfg.max_output_bytes, uid
                )
            finally:
                _kill_tree(proc, uid)
            duration = time.monotonic() - start
        code_ = proc.returncode
        if self.isolation == "bwrap" and code_ > 128 and not timed_out:
            code_ = 128 - code_  # bwrap reports "killed by signal N" as 128 + N; normalise to -N
        if timed_out:
            code_ = -signal.SIGKILL
        result = SandboxResult(
            exit_code=code_,
            timed_out=timed_out,
            stdout=bytes(out.data).decode("utf-8", "replace"),
            stderr=bytes(err.data).decode("utf-8", "replace"),
            stdout_bytes=out.total,
            stderr_bytes=err.total,
            duration_s=duration,
            isolation=self.isolation,
        )
        logger.debug(
            "sandbox run: isolation=%s exit=%s timed_out=%s %.3fs",
            result.isolation,
            result.exit_code,
            result.timed_out,
            duration,
        )
        return result


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------


def resolve_python(configured: str) -> str:
    """The interpreter the sandbox runs: configured, or the base install (not a venv) of this one."""
    if configured:
        path = shutil.which(configured) or configured
        if not os.access(path, os.X_OK):
            raise SandboxError(f"sandbox.python: '{configured}' is not an executable interpreter")
        return os.path.realpath(path)
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _prefix_of(python: str) -> str:
    """The install directory of an interpreter (…/bin/python3 → …)."""
    return str(Path(python).parent.parent)


def readable_by_others(path: str) -> bool:
    """Whether an unprivileged uid can reach and run `path` and read its install."""
    p = Path(path)
    for d in [p, *p.parents]:
        mode = d.stat().st_mode
        if d != p and not mode & stat.S_IXOTH:
            return False
    return bool(p.stat().st_mode & stat.S_IXOTH)


def _bwrap_argv(cfg: SandboxConfig, python: str, uid: int | None, code_fd: int) -> list[str]:
    """bwrap arguments: namespaces, a minimal read-only root, scratch tmpfs, cleared env."""
    argv = [
        "bwrap",
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
    if uid is None:
        argv += ["--unshare-user", "--disable-userns"]  # unprivileged bwrap needs a user namespace
    argv += ["--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    made: set[str] = {"/", "/usr", "/etc", "/tmp", "/proc", "/dev", "/sandbox"}
    for path in [_prefix_of(python), *cfg.ro_binds]:
        path = os.path.realpath(path)
        if path.startswith("/usr/"):
            continue
        # Create parents world-searchable: bwrap would copy the host's modes (e.g. /root is 0700),
        # leaving the unprivileged uid unable to reach the interpreter.
        for parent in reversed(Path(path).parents):
            if str(parent) not in made:
                argv += ["--perms", "0755", "--dir", str(parent)]
                made.add(str(parent))
        argv += ["--ro-bind", path, path]
        made.add(path)
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--perms", "1777", "--size", str(cfg.scratch_mb << 20), "--tmpfs", "/tmp"]
    argv += ["--perms", "0555", "--dir", "/sandbox", "--perms", "0444"]
    argv += ["--ro-bind-data", str(code_fd), SANDBOX_MAIN, "--chdir", "/tmp"]
    for key, value in (
        ("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ("HOME", "/tmp"),
        ("TMPDIR", "/tmp"),
        ("LANG", "C.UTF-8"),
    ):
        argv += ["--setenv", key, value]
    argv.append("--")
    if uid is not None:
        argv += _setpriv(uid)
    return argv


def _setpriv(uid: int) -> list[str]:
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


def _process_prefix(uid: int | None) -> list[str]:
    """For isolation=process: drop privileges and die with the host worker."""
    base = _setpriv(uid)[:-1] if uid is not None else [shutil.which("setpriv") or "setpriv", "--no-new-privs"]
    return [*base, "--pdeathsig", "KILL", "--"]


def _limits_argv(cfg: SandboxConfig, uid: int | None) -> list[str]:
    """prlimit arguments; the limits hold from the interpreter's first instruction."""
    nproc = cfg.max_procs if uid is not None else _tasks_of_uid(os.getuid()) + cfg.max_procs
    soft_cpu = cfg.cpu_s
    return [
        shutil.which("prlimit") or "prlimit",
        f"--cpu={soft_cpu}:{soft_cpu + 1}",  # SIGXCPU at the soft limit, SIGKILL one second later
        f"--as={cfg.memory_mb << 20}",
        f"--nproc={nproc}",
        f"--fsize={cfg.max_file_mb << 20}",
        "--core=0",
        "--nofile=256",
        "--",
    ]


def _memfd(name: str, data: bytes) -> int:
    """An in-memory file holding `data`, positioned at 0 (bwrap copies it into the sandbox)."""
    fd = os.memfd_create(name)
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data` to a blocking fd."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@functools.cache
def bwrap_problem(python: str, ro_binds: tuple[str, ...], root: bool) -> str | None:
    """Why bwrap cannot run the sandbox here, or None when a trial run works (cached)."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    cfg = SandboxConfig(ro_binds=list(ro_binds), timeout_s=20)
    fd = _memfd("probe.py", b"import sys; sys.stdout.write('ok')")
    try:
        with contextlib.ExitStack() as stack:
            uid = stack.enter_context(_UidLease()) if root else None
            argv = (
                _bwrap_argv(cfg, python, uid, fd)
                + _limits_argv(cfg, uid)
                + [python, "-I", "-S", SANDBOX_MAIN]
            )
            try:
                proc = subprocess.run(
                    argv, capture_output=True, pass_fds=(fd,), timeout=20, env={"PATH": "/usr/bin:/bin"}
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                return str(e)
    finally:
        os.close(fd)
    if proc.returncode != 0 or proc.stdout != b"ok":
        return f"trial run exited {proc.returncode}: {proc.stderr.decode(errors='replace').strip()[-500:]}"
    return None


# ---------------------------------------------------------------------------------------------
# Sandbox uids
# ---------------------------------------------------------------------------------------------


class _UidLease:
    """Exclusive use of one sandbox uid, across processes, via an flock on a file per uid.

    The kernel drops the lock when its holder dies, so a crashed host never leaks a uid.
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
            return uid
        raise SandboxError(f"all {UID_COUNT} sandbox uids are in use")

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing releases the flock


def _pids() -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes owned by `uid`: sandbox leftovers when uid is a sandbox's."""
    found = []
    for pid in _pids():
        with contextlib.suppress(OSError, IndexError):
            if os.stat(f"/proc/{pid}").st_uid == uid and _stat_fields(pid)[0] != b"Z":
                found.append(pid)
    return found


def _stat_fields(pid: int) -> list[bytes]:
    """Fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, session, ..."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def _tasks_of_uid(uid: int) -> int:
    """Tasks (processes and threads) of `uid`: what RLIMIT_NPROC counts."""
    total = 0
    for pid in pids_of_uid(uid):
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/task"))
    return total


def _kill_uid(uid: int, wait_s: float = 5.0) -> bool:
    """SIGKILL every process of a sandbox uid; True once none is left (waits up to wait_s).

    kill(-1) sent from that uid reaches all its processes in one sweep, so a fork bomb cannot
    outrun it; the wait covers processes that are still being torn down by the kernel.
    """
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while pids_of_uid(uid):
        if time.monotonic() > deadline:
            return False
        subprocess.run([*_setpriv(uid), shutil.which("kill") or "kill", "-KILL", "-1"], capture_output=True)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True


def _session_members(sid: int) -> list[int]:
    """Processes whose session id is `sid` (children keep it unless they call setsid)."""
    found = []
    for pid in _pids():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(_stat_fields(pid)[3]) == sid:
                found.append(pid)
    return found


def _kill_tree(proc: subprocess.Popen[bytes], uid: int | None) -> None:
    """Kill whatever the run left behind: its session, and every process of its uid."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()
    if uid is not None:
        if not _kill_uid(uid):
            logger.error("sandbox uid %d still has processes %s after SIGKILL", uid, pids_of_uid(uid))
    else:
        for pid in _session_members(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# I/O
# ---------------------------------------------------------------------------------------------


class _Tail:
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


def _communicate(
    proc: subprocess.Popen[bytes], stdin: bytes, deadline: float, limit: int, uid: int | None
) -> tuple[_Tail, _Tail, bool]:
    """Feed stdin and collect output tails until both pipes close or the deadline passes."""
    assert proc.stdin and proc.stdout and proc.stderr
    out, err = _Tail(limit), _Tail(limit)
    tails = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    pending = memoryview(stdin)
    sel = selectors.DefaultSelector()
    for fd in tails:
        sel.register(fd, selectors.EVENT_READ)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    exited_at: float | None = None
    timed_out = False
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                # The program exited but something it started still holds the pipes.
                _kill_tree(proc, uid)
                exited_at = now
            for key, _ in sel.select(timeout=min(deadline - now, 0.1)):
                fd = key.fd
                if fd in tails:
                    chunk = os.read(fd, 1 << 20)
                    if chunk:
                        tails[fd].add(chunk)
                    else:
                        sel.unregister(fd)
                else:
                    try:
                        pending = pending[os.write(fd, pending[: 1 << 16]) :]
                    except (BrokenPipeError, BlockingIOError) as e:
                        if isinstance(e, BrokenPipeError):
                            pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
    finally:
        sel.close()
        if not proc.stdin.closed:
            proc.stdin.close()
        if timed_out:
            _kill_tree(proc, uid)
            _drain(proc, tails)
        proc.stdout.close()
        proc.stderr.close()
    return out, err, timed_out


def _drain(proc: subprocess.Popen[bytes], tails: dict[int, _Tail]) -> None:
    """After a kill, read what is left in the pipes (bounded: the writers are dead)."""
    for fd, tail in tails.items():
        os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError, OSError):
            for _ in range(64):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                tail.add(chunk)
