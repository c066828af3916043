"""The programs that run inside the sandbox, as source text read from their shipped files.

They live in `inside/`, are standalone (standard library only, never imported by loopline) and
are copied into the sandbox as files, so what runs there is exactly the file that was linted and
tested on its own (tests/envs/test_sandbox_inside.py).
"""

from __future__ import annotations

from importlib import resources

INSIDE = resources.files("loopline.envs.sandbox").joinpath("inside")


def inside_source(name: str) -> str:
    """The source of `inside/<name>` (e.g. "zygote.py", "judge.py")."""
    return INSIDE.joinpath(name).read_text(encoding="utf-8")
