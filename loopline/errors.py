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
