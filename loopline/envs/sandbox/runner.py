"""Run untrusted, model-written Python under OS isolation and hard resource limits.

Two isolation levels, chosen by `SandboxConfig.isolation`:

- "bwrap": bubblewrap. No network (own net namespace), own PID/IPC/UTS namespaces, an empty
  root with only /usr (plus /bin, /lib symlinks) and the interpreter's install bound read-only,
  a fresh /proc and /dev, a size-capped private tmpfs on /tmp as the scratch dir, a cleared
  environment, --die-with-parent and --new-session.
- "process": a plain subprocess with the same rlimits and a scratch dir in the host's temp dir.
  The code sees the host file system and network: a loud warning is logged.

When the host runs as root, the code runs under a uid of its own, leased per sandbox process
(`_UidLease`): RLIMIT_NPROC only bites for non-root uids, a non-root uid cannot signal or read
the host's processes, and "every process of this uid" is exactly the sandbox, which is how
leftovers are found and killed. Limits are set by `prlimit` before the interpreter starts, so
they cover the whole process tree; the wall-clock limit is enforced from outside by killing the
session (and, for bwrap, the PID namespace dies with its init).

Warm sandboxes (`reuse_runs` > 0): starting bwrap and an interpreter costs tens of ms, more than
most checks. A warm sandbox is one sandboxed "zygote" interpreter that forks a child per run
(inheriting all limits), and after each run kills every other process of its uid, wipes the
scratch dir, and reports the exit status. Each run gets its own stdin/stdout/stderr pipes,
handed over as file descriptors. The zygote is non-dumpable, so runs (same uid) cannot ptrace
it or read its memory or fds; they can only kill it, which ends that sandbox. On a timeout, or
anything unexpected, the whole sandbox is killed and a fresh one started for the next run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import inspect
import logging
import os
import random
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
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
    reuse_runs: int = Field(
        100,
        ge=0,
        description="Runs served by one warm sandbox (its leftovers killed, scratch wiped between runs) "
        "before it is replaced; 0 = a fresh sandbox for every run.",
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
        # Warm reuse needs "kill every other process of my uid" to mean "of this sandbox": a PID
        # namespace (bwrap) or a leased uid (root).
        self.reuses = self.config.reuse_runs > 0 and (self.isolation == "bwrap" or self._root)
        self._warm: _Warm | None = None
        self._warm_lock = threading.Lock()

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
        start = time.monotonic()
        # One warm sandbox per Sandbox: a concurrent caller gets a fresh one instead of waiting.
        if self.reuses and self._warm_lock.acquire(blocking=False):
            try:
                code_, timed_out, out, err = self._run_warm(code, stdin)
            finally:
                self._warm_lock.release()
        else:
            code_, timed_out, out, err = self._run_fresh(code, stdin)
        result = SandboxResult(
            exit_code=-signal.SIGKILL if timed_out else code_,
            timed_out=timed_out,
            stdout=bytes(out.data).decode("utf-8", "replace"),
            stderr=bytes(err.data).decode("utf-8", "replace"),
            stdout_bytes=out.total,
            stderr_bytes=err.total,
            duration_s=time.monotonic() - start,
            isolation=self.isolation,
        )
        logger.debug(
            "sandbox run: isolation=%s exit=%s timed_out=%s %.3fs",
            result.isolation,
            result.exit_code,
            result.timed_out,
            result.duration_s,
        )
        return result

    def _run_fresh(self, code: str, stdin: bytes) -> tuple[int, bool, _Tail, _Tail]:
        """A new sandbox for this run only."""
        cfg = self.config
        with contextlib.ExitStack() as stack:
            uid = stack.enter_context(_UidLease()) if self._root else None
            if self.isolation == "bwrap":
                code_fd = _memfd("main.py", code.encode())
                stack.callback(os.close, code_fd)
                main, pass_fds, scratch = SANDBOX_MAIN, (code_fd,), None
            else:
                scratch = stack.enter_context(_scratch_dir(uid))
                Path(scratch, "main.py").write_text(code)
                Path(scratch, "main.py").chmod(0o444)
                main, pass_fds, code_fd = str(Path(scratch, "main.py")), (), None
            proc = self._launch([main], uid, code_fd, scratch, pass_fds, stdin=subprocess.PIPE)
            assert proc.stdin and proc.stdout and proc.stderr
            exited_at: list[float] = []

            def stalled(now: float) -> None:
                # The program exited but something it started still holds the pipes.
                if not exited_at and proc.poll() is not None:
                    exited_at.append(now)
                if exited_at and now - exited_at[-1] > 0.5:
                    _kill_tree(proc, uid, self.isolation)
                    exited_at.append(now)

            stdin_fd = os.dup(proc.stdin.fileno())  # _pump owns (and closes) this one
            proc.stdin.close()
            try:
                out, err, timed_out = _pump(
                    stdin_fd,
                    stdin,
                    proc.stdout.fileno(),
                    proc.stderr.fileno(),
                    time.monotonic() + cfg.timeout_s,
                    cfg.max_output_bytes,
                    stalled,
                )
            finally:
                proc.stdout.close()
                proc.stderr.close()
                _kill_tree(proc, uid, self.isolation)
        code_ = proc.returncode
        if self.isolation == "bwrap" and code_ > 128:
            code_ = 128 - code_  # bwrap reports "killed by signal N" as 128 + N; normalise to -N
        return code_, timed_out, out, err

    def _run_warm(self, code: str, stdin: bytes) -> tuple[int, bool, _Tail, _Tail]:
        """The run on this Sandbox's warm sandbox, started (again) when needed."""
        for _ in range(2):  # a sandbox that died between runs is replaced once
            if self._warm is not None and (not self._warm.alive or self._warm.runs >= self.config.reuse_runs):
                self._warm.close()
                self._warm = None
            if self._warm is None:
                try:
                    self._warm = _Warm(self)
                except SandboxError as e:
                    logger.warning("warm sandbox did not start (%s); running without reuse", e)
                    self.reuses = False
                    break
            try:
                return self._warm.run(code, stdin)
            except _WarmGone as e:
                logger.warning("warm sandbox was gone before a run (%s); replacing it", e)
        return self._run_fresh(code, stdin)

    def _launch(
        self,
        main_args: list[str],
        uid: int | None,
        code_fd: int | None,
        scratch: str | None,
        pass_fds: tuple[int, ...],
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        """Start the interpreter with `main_args` under the configured isolation and limits."""
        if self.isolation == "bwrap":
            argv = _bwrap_argv(self.config, self.python, uid, code_fd)
            cwd, env = "/", {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        else:
            assert scratch is not None
            argv = _process_prefix(uid)
            cwd = scratch
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": scratch,
                "TMPDIR": scratch,
                "LANG": "C.UTF-8",
            }
        argv += _limits_argv(self.config, uid) + [self.python, *self.python_flags, *main_args]
        defaults: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        return subprocess.Popen(
            argv,
            pass_fds=pass_fds,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its own session: killpg reaches the whole tree
            **{**defaults, **popen},
        )

    def close(self) -> None:
        """Stop the warm sandbox, if any (also done when this process exits)."""
        with self._warm_lock:
            if self._warm is not None:
                self._warm.close()
                self._warm = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Warm sandboxes
# ---------------------------------------------------------------------------------------------


@functools.cache
def _launcher() -> ThreadPoolExecutor:
    """The thread that starts warm sandboxes (see _Warm); idle, it waits for the next one."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-launcher")


class _WarmGone(Exception):
    """The warm sandbox died between runs (e.g. killed by the previous run); nothing ran."""


class _Warm:
    """One sandboxed zygote serving runs in turn; see the module docstring."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.runs = 0
        self.alive = True
        self._closed = False
        self._stack = contextlib.ExitStack()
        try:
            self.uid = self._stack.enter_context(_UidLease()) if sandbox._root else None
            if sandbox.isolation == "bwrap":
                scratch: str | None = None
                where = ["/tmp", SANDBOX_MAIN]  # scratch dir, and the path runs see as argv[0]
            else:
                scratch = self._stack.enter_context(_scratch_dir(self.uid))
                where = [scratch, str(Path(scratch, "main.py"))]
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
                        ["-c", ZYGOTE_PROGRAM, str(theirs.fileno()), *where],
                        self.uid,
                        None,
                        scratch,
                        (theirs.fileno(),),
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

    def run(self, code: str, stdin: bytes) -> tuple[int, bool, _Tail, _Tail]:
        cfg = self.sandbox.config
        deadline = time.monotonic() + cfg.timeout_s
        self.runs += 1
        program = _memfd("main.py", code.encode())
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        try:
            socket.send_fds(self.control, [b"r"], [program, stdin_r, stdout_w, stderr_w])
        except OSError as e:
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            self.close()
            raise _WarmGone(str(e)) from e
        finally:
            for fd in (program, stdin_r, stdout_w, stderr_w):
                os.close(fd)
        try:
            # The outputs close when the run and everything it started are dead (the zygote
            # kills leftovers before it reports), or when the whole sandbox is killed.
            out, err, timed_out = _pump(
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
            _kill_tree(self.proc, self.uid, self.sandbox.isolation)
        self._stack.close()


def _zygote_main() -> None:
    """In the sandbox: fork a child per run request from the host; clean up after each."""
    import ctypes
    import os
    import socket
    import sys

    control = socket.socket(fileno=int(sys.argv[1]))
    scratch, main_path = sys.argv[2], sys.argv[3]
    # Runs share our uid: non-dumpable, they cannot ptrace us nor open /proc/<us>/{mem,fd}.
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        sys.exit("zygote: prctl(PR_SET_DUMPABLE, 0) failed")
    me, uid = os.getpid(), os.getuid()
    control.sendall(b"ready\n")
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 16, 4)
        except OSError:
            return
        if len(fds) != 4:
            return  # the host closed the connection
        program_fd, stdin_fd, stdout_fd, stderr_fd = fds
        with open(program_fd, "rb") as f:
            source = f.read()
        pid = os.fork()
        if pid == 0:
            control.close()
            _zygote_child(source, stdin_fd, stdout_fd, stderr_fd, scratch, main_path)
        for fd in (stdin_fd, stdout_fd, stderr_fd):
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        try:
            clean = _zygote_cleanup(me, uid, scratch)
        except Exception:  # e.g. the run made part of scratch unreadable: replace the sandbox
            clean = False
        control.sendall(f"{os.waitstatus_to_exitcode(status)} {int(clean)}\n".encode())


def _zygote_child(
    source: bytes, stdin_fd: int, stdout_fd: int, stderr_fd: int, scratch: str, main_path: str
) -> None:
    """Run one program as `python main.py` would, in a forked child of the zygote."""
    import atexit
    import builtins
    import os
    import sys
    import types

    code = 1
    try:
        for fd, target in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(scratch)
        main = types.ModuleType("__main__")
        main.__file__ = main_path
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        sys.argv[:] = [main_path]
        try:
            exec(compile(source, main_path, "exec"), main.__dict__)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException as e:  # noqa: BLE001 - like the interpreter: print it, exit 1
            import traceback

            tb = e.__traceback__.tb_next if e.__traceback__ else None  # hide this function's frame
            traceback.print_exception(type(e), e, tb)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:  # noqa: SIM105 - no contextlib import in the zygote
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _zygote_cleanup(me: int, uid: int, scratch: str) -> bool:
    """Kill every other process of our uid, wipe the scratch dir; False if something remains."""
    import os
    import shutil
    import signal
    import time

    deadline = time.monotonic() + 5
    while _pids_of_uid(uid, exclude=me):
        if time.monotonic() > deadline:
            return False
        try:  # noqa: SIM105 - no contextlib import in the zygote
            os.kill(-1, signal.SIGKILL)  # every process of this uid but us, in one sweep
        except OSError:
            pass
        time.sleep(0.001)
    for entry in os.scandir(scratch):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            try:  # noqa: SIM105 - no contextlib import in the zygote
                os.unlink(entry.path)
            except OSError:
                pass
    if os.listdir(scratch):
        return False
    # SysV IPC objects outlive processes; we cannot remove them here, so report (and recycle).
    for table in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        if any(len(r.split()) > 7 and str(uid) in r.split()[4:8] for r in rows):
            return False
    return True


def _pids_of_uid(uid: int, exclude: int = -1) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`.

    Reads /proc/<pid>/status: the owner of /proc/<pid> is root for non-dumpable processes,
    which any process can make itself.
    """
    import os

    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == exclude:
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


ZYGOTE_PROGRAM = "\n\n".join(
    ["from __future__ import annotations"]
    + [inspect.getsource(f) for f in (_pids_of_uid, _zygote_cleanup, _zygote_child, _zygote_main)]
    + ["_zygote_main()\n"]
)


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


def _bwrap_argv(cfg: SandboxConfig, python: str, uid: int | None, code_fd: int | None) -> list[str]:
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
    argv += ["--perms", "0555", "--dir", "/sandbox"]
    if code_fd is not None:
        argv += ["--perms", "0444", "--ro-bind-data", str(code_fd), SANDBOX_MAIN]
    argv += ["--chdir", "/tmp"]
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
    return [
        shutil.which("prlimit") or "prlimit",
        f"--cpu={cfg.cpu_s}:{cfg.cpu_s + 1}",  # SIGXCPU at the soft limit, SIGKILL one second later
        f"--as={cfg.memory_mb << 20}",
        f"--nproc={nproc}",
        f"--fsize={cfg.max_file_mb << 20}",
        "--core=0",
        "--nofile=256",
        "--",
    ]


@contextlib.contextmanager
def _scratch_dir(uid: int | None) -> Iterator[str]:
    """A host temp dir owned by the sandbox uid (isolation=process)."""
    with tempfile.TemporaryDirectory(prefix="loopline-sandbox-") as scratch:
        if uid is not None:
            os.chown(scratch, uid, uid)
        yield scratch


def _memfd(name: str, data: bytes) -> int:
    """An in-memory file holding `data`, positioned at 0."""
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


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
# Sandbox uids and leftovers
# ---------------------------------------------------------------------------------------------


class _UidLease:
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
            if not _kill_uid(uid):
                self.__exit__()
                raise SandboxError(
                    f"cannot clear leftover processes of sandbox uid {uid}: {pids_of_uid(uid)}"
                )
            return uid
        raise SandboxError(f"all {UID_COUNT} sandbox uids are in use")

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing releases the flock


def pids_of_uid(uid: int) -> list[int]:
    """Live processes whose real uid is `uid` (sandbox leftovers, when uid is a sandbox's)."""
    return _pids_of_uid(uid)


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
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[3]) == sid:
                found.append(int(name))
    return found


def _kill_tree(proc: subprocess.Popen[bytes], uid: int | None, isolation: Isolation) -> None:
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
        if not _kill_uid(uid):
            logger.error("sandbox uid %d still has processes %s after SIGKILL", uid, pids_of_uid(uid))
    elif isolation == "process":
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


def _pump(
    stdin_fd: int,
    stdin: bytes,
    stdout_fd: int,
    stderr_fd: int,
    deadline: float,
    limit: int,
    stalled: Callable[[float], None] | None,
) -> tuple[_Tail, _Tail, bool]:
    """Feed stdin and collect output tails until both outputs close or the deadline passes.

    Returns (stdout tail, stderr tail, timed out). Closes `stdin_fd` once everything is written
    (so the program sees EOF) and leaves the output fds open. `stalled(now)` is called on every
    turn, for the caller to deal with a writer that lingers.
    """
    out, err = _Tail(limit), _Tail(limit)
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


def _drain(tails: dict[int, _Tail]) -> None:
    """Read what is already in the pipes, without waiting for more."""
    for fd, tail in tails.items():
        os.set_blocking(fd, False)
        with contextlib.suppress(BlockingIOError, OSError):
            for _ in range(64):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                tail.add(chunk)
