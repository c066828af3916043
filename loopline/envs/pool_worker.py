"""A local env worker process: started by the pool (loopline/envs/pool.py) as a fresh interpreter running this
file's `main`, never the user's script.

multiprocessing's spawn would import the parent's `__main__` again in every worker (as `__mp_main__`): a script
that starts a run at module level, without `if __name__ == "__main__":`, would start one more run per worker (and
with overwrite=True delete the parent's). Here the worker's `__main__` is loopline's: its task function comes by
value, pickled with cloudpickle and sent as the first message over the worker's socket, with the parent's
sys.path so that what it names by reference imports as it did in the parent.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection

from loopline.envs.frames import pickled_by_value
from loopline.envs.pool_parts import _call
from loopline.errors import ENV_WORKER_VAR

READY = "ready"  # a worker's first message


def command(fd: int) -> list[str]:
    """The command line of a worker that talks over socket `fd`: this module's main in a fresh interpreter, with
    loopline importable from where this copy of it lives (it need not be installed)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    boot = f"import sys; sys.path.insert(0, {root!r}); from loopline.envs.pool_worker import main; main({fd})"
    return [sys.executable, "-c", boot]


def payload(fn: object) -> bytes:
    """What a worker loads first: the parent's sys.path and the task function, pickled by value where it cannot be
    imported by name (cloudpickle). Raises what cloudpickle raises for an object that cannot be pickled."""
    return pickle.dumps((list(sys.path), pickled_by_value(fn)))  # the path first: fn may name modules on it


def main(fd: int) -> None:
    """Body of a local worker process: load the task function, then answer (token, item) messages until told to
    stop.

    Ctrl-C in a terminal sends SIGINT to the whole process group, workers included: they ignore it (each printed a
    KeyboardInterrupt traceback and died), since the run's process handles it, finishes the step (whose scoring
    needs the workers) and then stops them. The worker starts with SIGINT blocked (the pool blocks it around the
    start: a signal mask survives fork and exec) until it is ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending one is dropped
    os.environ[ENV_WORKER_VAR] = str(
        os.getppid()
    )  # a run started here is refused (errors.refuse_in_env_worker)
    conn = Connection(fd)
    try:
        path, pickled = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):  # the pool closed before this worker was up
        return
    sys.path[:] = [*path, *(p for p in sys.path if p not in path)]
    try:
        fn = pickle.loads(pickled)
    except Exception as e:  # a module the task names that this process cannot import
        print(
            f"loopline env worker {os.getpid()}: cannot load its task: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        sys.exit(1)
    try:
        conn.send(READY)
    except OSError:  # the pool closed before this worker was up (a short run, a run that failed early)
        return
    _serve(conn, fn)


def _serve(conn: Connection, fn: object) -> None:
    """Answer (token, item) messages with fn's replies until a None or the pool's end of the socket closes."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the pool's process is gone
            return
        if message is None:
            return
        token, item = message
        reply = _call(fn, token, item)  # type: ignore[arg-type]
        try:
            conn.send(reply)
        except OSError:  # the pool's process is gone
            return
        except Exception as e:  # e.g. an unpicklable result
            conn.send((token, False, f"result could not be sent back: {type(e).__name__}: {e}"))
