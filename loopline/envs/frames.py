"""Where user code failed: the frames of an exception that are the user's own (a reward function's, an env's),
not loopline's, the standard library's or an installed package's, as one short block for an error message.

An env worker raises far from the user's eyes: the run's error says what was raised, and this block says where
in the user's files (file, line, function, source line), most recent call last, as Python prints a traceback.
"""

from __future__ import annotations

import linecache
import marshal
import os
import sysconfig
import traceback
import types
from pathlib import Path
from types import TracebackType

MAX_FRAMES = 5  # the innermost ones: where it raised, and what called it

_NOT_USERS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {
        str(Path(__file__).resolve().parents[1]),  # the loopline package
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    }
)


def pickled_by_value(obj: object) -> bytes:
    """`obj` pickled with cloudpickle (a function or class of the user's script or notebook by value: its code and
    the globals it uses), keeping its code's file names, which cloudpickle blanks (<dynamic-code>), so that an error
    in a worker can name the user's file and line. Raises what cloudpickle raises for what it cannot pickle."""
    import io
    from collections import ChainMap

    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        # marshal keeps every field of a code object; a worker runs the same Python as this process
        dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)

    with io.BytesIO() as file:
        Pickler(file).dump(obj)
        return file.getvalue()


def _code_reduce(code: types.CodeType) -> tuple[object, tuple[bytes]]:
    return marshal.loads, (marshal.dumps(code),)


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
