"""Where user code failed: the frames of an exception that are the user's own (a reward function's, an env's),
not loopline's, the standard library's or an installed package's, as one short block for an error message.

An env worker raises far from the user's eyes: the run's error says what was raised, and this block says where
in the user's files (file, line, function, source line), most recent call last, as Python prints a traceback.
"""

from __future__ import annotations

import linecache
import os
import sysconfig
import traceback
from pathlib import Path
from types import TracebackType

import loopline

MAX_FRAMES = 5  # the innermost ones: where it raised, and what called it

_NOT_USERS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {
        os.path.dirname(os.path.abspath(loopline.__file__)),
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    }
)


def is_users(filename: str) -> bool:
    """Whether code in `filename` is the user's: a real file outside loopline, the standard library, site- and
    dist-packages."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>, <stdin>
        return False
    path = str(Path(filename).resolve())
    parts = Path(path).parts
    return not path.startswith(_NOT_USERS) and "site-packages" not in parts and "dist-packages" not in parts


def _users(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    frames = traceback.extract_tb(tb)
    return [f for f in frames if is_users(f.filename)]


def user_frames(error: BaseException) -> str:
    """The user's frames of `error` (of the innermost exception of its chain that has any: the one the user's code
    raised, wrapped by loopline's), as an indented block; "" when none is the user's."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    for e in reversed(chain):  # the innermost first
        frames = _users(e.__traceback__)[-MAX_FRAMES:]
        if frames:
            lines = ["  in your code (most recent call last):"]
            for f in frames:
                lines.append(f'    File "{f.filename}", line {f.lineno}, in {f.name}')
                source = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
                if source:
                    lines.append(f"      {source}")
            return "\n".join(lines)
    return ""


def full_traceback(error: BaseException) -> str:
    """The whole traceback of `error`, its chain included, as Python prints it (for --debug)."""
    return "".join(traceback.format_exception(error))


class WorkerTraceback(Exception):
    """An env worker's whole traceback, set as the __cause__ of the error raised for it in the run's process, so
    that a printed traceback (the CLI's --debug) shows the worker's frames above the run's own."""

    def __str__(self) -> str:
        return f'in the env worker:\n"""\n{self.args[0] if self.args else ""}"""'
