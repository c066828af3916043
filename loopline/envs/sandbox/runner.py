"""`Sandbox`: runs one program under the configured isolation, fresh or on a warm sandbox."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from loopline.envs.sandbox.commands import (
    bwrap_argv,
    bwrap_problem,
    limits_argv,
    memfd,
    process_prefix,
    readable_by_others,
    resolve_python,
    scratch_dir,
)
from loopline.envs.sandbox.config import SANDBOX_MAIN, Isolation, SandboxConfig, SandboxError
from loopline.envs.sandbox.result import SandboxResult
from loopline.envs.sandbox.streams import Tail, pump
from loopline.envs.sandbox.uids import UidLease, kill_tree
from loopline.envs.sandbox.warm import Warm, WarmGone

logger = logging.getLogger(__name__)


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
        self._warm: Warm | None = None
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

    def _run_fresh(self, code: str, stdin: bytes) -> tuple[int, bool, Tail, Tail]:
        """A new sandbox for this run only."""
        cfg = self.config
        with contextlib.ExitStack() as stack:
            uid = stack.enter_context(UidLease()) if self._root else None
            if self.isolation == "bwrap":
                code_fd = memfd("main.py", code.encode())
                stack.callback(os.close, code_fd)
                main, pass_fds, scratch, files = SANDBOX_MAIN, (code_fd,), None, {SANDBOX_MAIN: code_fd}
            else:
                scratch = stack.enter_context(scratch_dir(uid))
                Path(scratch, "main.py").write_text(code)
                Path(scratch, "main.py").chmod(0o444)
                main, pass_fds, files = str(Path(scratch, "main.py")), (), {}
            proc = self._launch([main], uid, files, scratch, pass_fds, stdin=subprocess.PIPE)
            assert proc.stdin and proc.stdout and proc.stderr
            exited_at: list[float] = []

            def stalled(now: float) -> None:
                # The program exited but something it started still holds the pipes.
                if not exited_at and proc.poll() is not None:
                    exited_at.append(now)
                if exited_at and now - exited_at[-1] > 0.5:
                    kill_tree(proc, uid, self.isolation)
                    exited_at.append(now)

            stdin_fd = os.dup(proc.stdin.fileno())  # pump owns (and closes) this one
            proc.stdin.close()
            try:
                out, err, timed_out = pump(
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
                kill_tree(proc, uid, self.isolation)
        code_ = proc.returncode
        if self.isolation == "bwrap" and code_ > 128:
            code_ = 128 - code_  # bwrap reports "killed by signal N" as 128 + N; normalise to -N
        return code_, timed_out, out, err

    def _run_warm(self, code: str, stdin: bytes) -> tuple[int, bool, Tail, Tail]:
        """The run on this Sandbox's warm sandbox, started (again) when needed."""
        for _ in range(2):  # a sandbox that died between runs is replaced once
            if self._warm is not None and (not self._warm.alive or self._warm.runs >= self.config.reuse_runs):
                self._warm.close()
                self._warm = None
            if self._warm is None:
                try:
                    self._warm = Warm(self)
                except SandboxError as e:
                    logger.warning("warm sandbox did not start (%s); running without reuse", e)
                    self.reuses = False
                    break
            try:
                return self._warm.run(code, stdin)
            except WarmGone as e:
                logger.warning("warm sandbox was gone before a run (%s); replacing it", e)
        return self._run_fresh(code, stdin)

    def _launch(
        self,
        main_args: list[str],
        uid: int | None,
        files: dict[str, int],
        scratch: str | None,
        pass_fds: tuple[int, ...],
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        """Start the interpreter with `main_args` under the configured isolation and limits.

        `files`: in-memory files bound into bwrap (path under /sandbox → fd, also in `pass_fds`).
        """
        if self.isolation == "bwrap":
            argv = bwrap_argv(self.config, self.python, uid, files)
            cwd, env = "/", {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        else:
            assert scratch is not None
            argv = process_prefix(uid)
            cwd = scratch
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": scratch,
                "TMPDIR": scratch,
                "LANG": "C.UTF-8",
            }
        argv += limits_argv(self.config, uid) + [self.python, *self.python_flags, *main_args]
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
