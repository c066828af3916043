"""Which loopline this is: the package version and, in a git checkout, its commit (model cards, `loopline doctor`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__version__ = "0.1.0"  # pyproject.toml's [project] version; the package re-exports it
REPO = Path(__file__).resolve().parents[1]  # the checkout loopline is imported from (a git work tree, or not)


def commit() -> str | None:
    """The checkout's commit (40 hex digits, "+dirty" when files differ from it), or None outside a git checkout."""
    if not (REPO / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def version() -> str:
    """loopline's version and commit, e.g. "0.1.0 (commit 1a2b...)", "(commit unknown)" outside a git checkout."""
    return f"{__version__} (commit {commit() or 'unknown'})"
