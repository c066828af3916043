"""The warm sandbox's zygote: runs inside the sandbox, forks one child per run the host asks for.

Standalone (standard library only): the host copies this file into the sandbox (bwrap:
/sandbox/zygote.py) and starts it as `python -I -S zygote.py CONTROL_FD SCRATCH MAIN_PATH`, already
under the sandbox's uid, namespaces and rlimits, so every child inherits them.

Protocol on the control socket (CONTROL_FD, a Unix stream socket):
- the zygote sends b"ready\\n" once it is non-dumpable;
- the host sends one message per run, with 4 file descriptors attached: the program's source
  (read to EOF), and the run's stdin, stdout and stderr;
- the zygote forks a child that runs the source as `python MAIN_PATH` would, in SCRATCH, waits for
  it, kills every other process of its uid, wipes SCRATCH, and sends b"EXIT_STATUS CLEAN\\n"
  (CLEAN = 1 when nothing of the run is left, else 0: the host then replaces the sandbox);
- when the host closes the socket, the zygote exits.

Never run this as a user whose processes you care about: the cleanup kills every process of its
uid (it refuses to run as root, where that would be every process of the machine).
"""

from __future__ import annotations

# Only what the zygote needs to start; the rest is imported where it is used.
import ctypes
import os
import socket
import sys


def _zygote_main() -> None:
    """Fork a child per run request from the host; clean up after each."""
    if os.getuid() == 0:  # kill(-1) as root would reach every process of the machine
        sys.exit("zygote: refusing to run as root")
    control = socket.socket(fileno=int(sys.argv[1]))
    scratch, main_path = sys.argv[2], sys.argv[3]
    # Runs share our uid: non-dumpable, they cannot ptrace us nor open /proc/<us>/{mem,fd}.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        sys.exit("zygote: prctl(PR_SET_DUMPABLE, 0) failed")
    # Orphans of a run (a daemon's parent exits) become our children, not init's: the cleanup
    # reaps them, so their zombies do not linger (counted against RLIMIT_NPROC) until an init
    # that may reap slowly, or never, gets to them.
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        sys.exit("zygote: prctl(PR_SET_CHILD_SUBREAPER, 1) failed")
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
    """Kill every other process of our uid, wipe the scratch dir; False if something remains.

    Called once the run's main process has exited and been reaped: everything it wrote to its
    stdout/stderr is already in the host's pipes, so killing cannot lose the run's output. (A
    process that wants a child's buffered output, like the judge, waits for that child itself.)

    Sweep first, then look: a /proc scan is not a snapshot (it lists the pids, then reads each
    one's status), so a process can fork and exit between the two and its child is missed (a
    double-forking daemon did exactly that). kill(-1) is atomic against fork: a fork in progress
    either fails or its child is signalled too, so after one sweep no process of this uid can make
    a new one, and the sweeps repeat until a scan finds none left (or the deadline passes).
    """
    import shutil
    import signal
    import time

    deadline = time.monotonic() + 5
    while True:
        try:  # noqa: SIM105 - no contextlib import in the zygote
            os.kill(-1, signal.SIGKILL)  # every process of this uid but us, in one sweep
        except OSError:
            pass  # ESRCH: there was none
        if _reap() and not _pids_of_uid(uid, exclude=me):
            break
        if time.monotonic() > deadline:
            return False
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


def _reap() -> bool:
    """Reap every child (the run's orphans, see PR_SET_CHILD_SUBREAPER) that has exited; True
    when none is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return False


def _pids_of_uid(uid: int, exclude: int = -1) -> list[int]:
    """Live (not zombie) processes whose real uid is `uid`.

    Reads /proc/<pid>/status: the owner of /proc/<pid> is root for non-dumpable processes,
    which any process can make itself. (The host has its own copy: `uids.pids_of_uid`.)
    """
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


if __name__ == "__main__":
    _zygote_main()
