"""Errors that are the user's to fix (a bad path, file, row or value): the CLI prints them as one line and
exits with status 2, without a traceback (`loopline --debug ...` shows it). Anything else is a bug in
loopline and keeps its traceback."""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: the message names the thing at fault (key, path, file and row) and what is accepted."""


# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry". Distinct from a bug's 1, a user
# error's 2 and a signal's 128+n, so that a job controller (and a person) can tell a run worth retrying.
EXIT_TEMPFAIL = 75


class WorkersLost(RuntimeError):
    """Worker processes were lost (killed, their node gone) more often than runtime.max_restarts recovers: neither
    a bug nor the user's input. The CLI prints the message as one line and exits with EXIT_TEMPFAIL, which a job
    controller's retry (loopline k8s: the RayJob's backoffLimit) turns into a fresh attempt that resumes."""


# Set in every env worker (local process or Ray actor) to the pid of the process it works for: user code that the
# worker loads and that starts a run at import (a script without `if __name__ == "__main__":`) is refused there.
ENV_WORKER_VAR = "LOOPLINE_ENV_WORKER"


def refuse_in_env_worker(what: str) -> None:
    """Raise UserError when this process is an env worker: a run started here would be a second run of the same
    script (its out_dir the first one's, deleted by overwrite=True); `what` names the call."""
    import os

    owner = os.environ.get(ENV_WORKER_VAR)
    if owner:
        raise UserError(
            f"{what} was called inside an env worker (pid {os.getpid()}, working for pid {owner}) while it loaded "
            "your code: the file that defines your reward function or env also starts a run when imported; start "
            'the run under `if __name__ == "__main__":`'
        )
