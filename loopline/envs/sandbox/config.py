"""What the sandbox is configured with: isolation level and limits, and its fixed names."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loopline.section import Section

Isolation = Literal["bwrap", "process"]

# Sandbox uids are leased from this range (host root only). Far above normal user and
# container uids, so no host file or process belongs to them.
UID_BASE = 1_000_000
UID_COUNT = 4096
# Where the code file appears inside bwrap, and the warm sandbox's zygote (inside/zygote.py).
SANDBOX_MAIN = "/sandbox/main.py"
SANDBOX_ZYGOTE = "/sandbox/zygote.py"


class SandboxConfig(Section):
    """How untrusted code is isolated and limited."""

    isolation: Literal["auto", "bwrap", "process"] = Field(
        "auto", description="bwrap (namespaces), process (rlimits only, weak), or auto: bwrap if it works."
    )
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit; the whole process tree is killed.")
    cpu_s: int = Field(10, gt=0, description="CPU-seconds limit per process (RLIMIT_CPU).")
    memory_mb: int = Field(1024, gt=0, description="Address-space limit per process (RLIMIT_AS), MiB.")
    max_procs: int = Field(16, gt=0, description="Processes and threads the code may have (RLIMIT_NPROC).")
    max_file_mb: int = Field(16, gt=0, description="Largest file the code may write (RLIMIT_FSIZE), MiB.")
    scratch_mb: int = Field(64, gt=0, description="Size of the private /tmp scratch tmpfs (bwrap), MiB.")
    max_output_bytes: int = Field(
        65536, gt=0, description="Bytes kept of stdout and of stderr each; the tail is kept."
    )
    reuse_runs: int = Field(
        100,
        ge=0,
        description="Runs served by one warm sandbox (its leftovers killed, scratch wiped between runs) "
        "before it is replaced; 0 = a fresh sandbox for every run.",
    )
    python: str = Field(
        "", description="Interpreter inside the sandbox; empty = the base install running loopline."
    )
    site_packages: bool = Field(
        False, description="Let the code import the interpreter's site-packages (site.py runs: slower start)."
    )
    ro_binds: list[str] = Field(
        default_factory=list, description="Extra host paths bound read-only into bwrap (e.g. a venv)."
    )


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not an error of the code it runs)."""
