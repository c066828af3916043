"""Errors that are the user's to fix (a bad path, file, row or value): the CLI prints them as one line and
exits with status 2, without a traceback (`loopline --debug ...` shows it). Anything else is a bug in
loopline and keeps its traceback."""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: the message names the thing at fault (key, path, file and row) and what is accepted."""
