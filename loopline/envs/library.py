"""What the adapters of environment libraries share (env.name=LIBRARY:MODULE[:NAME], envs/verifiers_env.py and
envs/openenv_env.py): the library imported only when such an env is named, with one line naming the extra when it
is missing, and the object that NAME names in the user's module or file, imported as python:MODULE:FACTORY is."""

from __future__ import annotations

import importlib
import types
from typing import Any

from loopline.envs.config import LIBRARY_ENV
from loopline.envs.episodes import EnvError, import_env_module

EXTRA = "pip install 'loopline[envs]'"  # the extra that installs every library an adapter runs


def require(name: str, module: str) -> types.ModuleType:
    """The library module `module`, for env.name=`name`; missing, one line saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        library = name.partition(":")[0]
        raise EnvError(
            f"env.name={name} runs an environment of the {library} library, which is not installed "
            f"({type(e).__name__}: {e}): {EXTRA}"
        ) from None


def named(name: str, default: str | None) -> tuple[str, Any]:
    """(NAME, the object) that env.name=LIBRARY:MODULE[:NAME] names, NAME else `default`; with no default, the
    whole module (the adapter picks from it)."""
    match = LIBRARY_ENV.match(name)
    if match is None:
        raise EnvError(f"unknown env {name!r}: expected LIBRARY:MODULE[:NAME]")
    module = import_env_module(match["module"], name)
    attr = match["name"] or default
    if attr is None:
        return "", module
    if not hasattr(module, attr):
        raise EnvError(f"env.name={name}: {match['module']} has no {attr!r}")
    return attr, getattr(module, attr)
