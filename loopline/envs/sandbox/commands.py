"""Command lines that start a sandbox: bwrap, prlimit, setpriv; and the probe that bwrap works."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from loopline.envs.sandbox.config import SANDBOX_MAIN, SandboxConfig, SandboxError
from loopline.envs.sandbox.uids import UidLease, setpriv_argv, tasks_of_uid


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


def bwrap_argv(cfg: SandboxConfig, python: str, uid: int | None, files: dict[str, int]) -> list[str]:
    """bwrap arguments: namespaces, a minimal read-only root, scratch tmpfs, cleared env.

    `files` maps a path under /sandbox to the fd of an in-memory file bound there read-only.
    """
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
    for path, fd in files.items():
        argv += ["--perms", "0444", "--ro-bind-data", str(fd), path]
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
        argv += setpriv_argv(uid)
    return argv


def process_prefix(uid: int | None) -> list[str]:
    """For isolation=process: drop privileges and die with the host worker."""
    base = (
        setpriv_argv(uid)[:-1]
        if uid is not None
        else [shutil.which("setpriv") or "setpriv", "--no-new-privs"]
    )
    return [*base, "--pdeathsig", "KILL", "--"]


def limits_argv(cfg: SandboxConfig, uid: int | None) -> list[str]:
    """prlimit arguments; the limits hold from the interpreter's first instruction."""
    nproc = cfg.max_procs if uid is not None else tasks_of_uid(os.getuid()) + cfg.max_procs
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
def scratch_dir(uid: int | None) -> Iterator[str]:
    """A host temp dir owned by the sandbox uid (isolation=process)."""
    with tempfile.TemporaryDirectory(prefix="loopline-sandbox-") as scratch:
        if uid is not None:
            os.chown(scratch, uid, uid)
        yield scratch


def memfd(name: str, data: bytes) -> int:
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
    fd = memfd("probe.py", b"import sys; sys.stdout.write('ok')")
    try:
        with contextlib.ExitStack() as stack:
            uid = stack.enter_context(UidLease()) if root else None
            argv = (
                bwrap_argv(cfg, python, uid, {SANDBOX_MAIN: fd})
                + limits_argv(cfg, uid)
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
