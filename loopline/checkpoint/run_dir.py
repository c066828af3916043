"""A run directory kept safe across starts and resumes: a new run never writes over an old one, and a resumed
run keeps the config it was started with.

- A new run (no --resume) refuses an out_dir that holds a run (config.yaml, metrics.jsonl or checkpoints/);
  --overwrite deletes that run's own files first (RUN_ENTRIES; anything else in the directory stays). The
  old run is deleted, not moved aside: out_dir is often a mount point (a Kubernetes volume), which cannot be
  renamed.
- A resumed run starts from its saved config.yaml. A config file and overrides given with --resume apply on
  top of it, but only the fields of RESUMABLE may differ (how and where the run executes, how often it saves
  and evaluates, how long it goes): any other difference is refused, naming the fields and both values,
  unless --allow-config-change.
- config_history.jsonl records every start and resume (and restart after a failure), with what changed.

No torch here: these checks run before any model is built.
"""

from __future__ import annotations

import difflib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from loopline.config import RunConfig, absolute_paths, load_config, relative_paths
from loopline.errors import UserError
from loopline.section import flat_values
from loopline.version import version

HISTORY_FILE = "config_history.jsonl"
# The run's config beside a model it exported (config.json there is the model's): what data, env and task it
# learned, read by `loopline eval` of that model.
RUN_CONFIG = "loopline_run.yaml"

# What a run writes into its out_dir: --overwrite deletes these and nothing else.
RUN_ENTRIES = (
    "config.yaml", HISTORY_FILE, "metrics.jsonl", "ledger.jsonl", "checkpoints", "tensorboard", "curves.png",
    "model", "reward_model", "scale_request.json", "wandb_run.json", "wandb",
)  # fmt: skip
# Held locked by the process that owns the run (owning()); not a run file: --overwrite leaves it.
LOCK_FILE = ".loopline.lock"
_OWNED: dict[str, int] = {}  # the run directories this process owns -> the descriptor holding the lock
# Their presence makes a directory a run's: a new run there would mix with or destroy it.
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")

# The commands that take --resume, and the checkpoint phases each continues (another command's run is refused).
RESUMED_PHASES = {"train": ("sft", "grpo"), "sft": ("sft",), "dpo": ("sft", "dpo"), "rm": ("sft", "rm")}
# Config fields a resume may change (fnmatch patterns on dotted keys); what the run trains on, and how, stays.
RESUMABLE = (
    "out_dir",  # the run directory moved (copied elsewhere, mounted at another path)
    "sft.steps", "grpo.steps", "dpo.steps", "rm.steps",  # extend (or end) a phase; the LR schedule follows the new length
    "runtime.*",  # rescale: backend, ranks, engines, env workers, timeouts, cluster
    "k8s.*",  # where it runs on Kubernetes (the pods' sizes, image, queue)
    "checkpoint.*", "checkpoint_every",
    "sft.eval_every", "grpo.eval_every", "dpo.eval_every", "rm.eval_every", "eval.batch_size",  # when eval runs, not what it measures
    "threads", "deterministic", "progress", "tensorboard", "metrics.*",  # where the metrics go, not what they are
)  # fmt: skip


def holds_run(run_dir: str | Path) -> list[str]:
    """The run files in `run_dir` (RUN_MARKERS present), [] for a directory no run has written to."""
    return [name for name in RUN_MARKERS if (Path(run_dir) / name).exists()]


@contextmanager
def owning(run_dir: str | Path) -> Iterator[None]:
    """This process owns the run in `run_dir` while the block runs: it holds an exclusive lock on
    run_dir/LOCK_FILE, and only the owner may delete the run (--overwrite) or write it. A run already owned by
    another live process (the same out_dir started, resumed or overwritten twice at once) is refused with a
    UserError before anything is deleted. Re-entrant within a process; a filesystem without locks goes unguarded."""
    key = str(Path(run_dir).resolve())
    if key in _OWNED:
        yield
        return
    created = not Path(run_dir).exists()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, _, host = os.read(fd, 256).decode(errors="replace").strip().partition(" ")
        os.close(fd)
        if host and host != socket.gethostname():
            # a shared volume (a Kubernetes pod restarted elsewhere): its lock may outlive a dead holder until the
            # server's lease ends, and a refusal here would end a job that a retry must resume
            print(f"loopline: warning: out_dir {run_dir} is locked from host {host} (pid {pid}); going on")
            yield
            return
        raise UserError(
            f"out_dir {run_dir} belongs to a run that is still going (pid {pid or '?'}): let it end or stop it, "
            "or choose another out_dir"
        ) from None
    except OSError:  # no locks here (some network filesystems)
        os.close(fd)
        yield
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    _OWNED[key] = fd
    try:
        yield
    finally:
        del _OWNED[key]
        # a run that wrote nothing (refused at its checks) leaves nothing, not even its lock
        if [p.name for p in Path(run_dir).iterdir()] == [LOCK_FILE]:
            (Path(run_dir) / LOCK_FILE).unlink()
            if created:
                Path(run_dir).rmdir()
        os.close(fd)  # releases the lock


def prepare_new_run(run_dir: str | Path, overwrite: bool, command: str = "train") -> None:
    """Before a new run in `run_dir`: refuse one that holds a run, or (overwrite) delete that run's files. Only the
    run's owner (owning()) may call it."""
    run_dir = Path(run_dir)
    found = holds_run(run_dir)
    if not found:
        return
    if not overwrite:
        resume = (
            f" continue it with `loopline {command} --resume out_dir={run_dir}`,"
            if command in RESUMED_PHASES
            else ""
        )
        raise UserError(
            f"out_dir {run_dir} holds a run ({', '.join(found)}):{resume} or pass --overwrite to delete it and "
            "start afresh, or choose another out_dir"
        )
    deleted = []
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        deleted.append(name)
    print(f"--overwrite: deleted the run in {run_dir} ({', '.join(deleted)})")


def config_changes(old: RunConfig, new: RunConfig) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} of every field that differs."""
    a, b = flat_values(old.model_dump(mode="json")), flat_values(new.model_dump(mode="json"))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def resumable(key: str) -> bool:
    return any(fnmatch(key, pattern) for pattern in RESUMABLE)


def _nearby_runs(run_dir: Path) -> list[str]:
    """Run directories beside `run_dir` (its parent's), the likeliest meant first (spelt alike), at most five."""
    parent = run_dir.parent if str(run_dir.parent) else Path(".")
    try:
        runs = sorted(str(p) for p in parent.iterdir() if p.is_dir() and holds_run(p))
    except OSError:  # no parent, or one that cannot be read
        return []
    alike = difflib.get_close_matches(str(run_dir), runs, n=5, cutoff=0.6)
    return [*alike, *(r for r in runs if r not in alike)][:5]


def no_run_to_resume(run_dir: str | Path) -> str:
    """The error of --resume given an out_dir that holds no run: a typo would start a whole run in the wrong place."""
    run_dir = Path(run_dir)
    what = (
        "does not exist"
        if not run_dir.exists()
        else "holds no run (no config.yaml, metrics.jsonl or checkpoints/)"
    )
    nearby = _nearby_runs(run_dir)
    beside = f"; runs beside it: {', '.join(nearby)}" if nearby else ""
    return (
        f"--resume: out_dir {run_dir} {what}{beside}. Check the out_dir, or start a new run there without --resume "
        "(--restart-unsaved starts one where there is nothing to resume, as job controllers rerunning one command do)"
    )


def started_in(run_dir: str | Path) -> Path | None:
    """The working directory the run in `run_dir` was started from (config_history.jsonl), None if not recorded."""
    history = Path(run_dir) / HISTORY_FILE
    if not history.is_file():
        return None
    for line in history.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("event") == "start" and entry.get("cwd"):
            return Path(entry["cwd"])
    return None


def _saved_paths_absolute(saved: RunConfig, saved_path: Path) -> RunConfig:
    """A saved config's relative paths (runs saved before paths were stored absolute) made absolute against the
    directory the run was started from; not recorded: against this one if they are there, else a clear error."""
    relative = relative_paths(saved)
    if not relative:
        return saved
    start = started_in(saved_path.parent)
    if start is None and not all(Path(v).exists() for v in relative.values()):
        listed = ", ".join(f"{k}='{v}'" for k, v in relative.items())
        raise UserError(
            f"the run's config ({saved_path}) holds paths relative to the directory the run was started from, "
            f"which it did not record: {listed}; resume from that directory, or give the paths absolute "
            "(with --allow-config-change)"
        )
    return absolute_paths(saved, start or Path.cwd())


def resume_config(
    path: str | None, overrides: list[str], allow_change: bool, fresh_ok: bool = False
) -> tuple[RunConfig, dict[str, tuple[Any, Any]]]:
    """The config of a resumed run, and what differs from its saved one; its paths absolute (PATH_KEYS).

    The run's saved config.yaml is the base; the config file and overrides given apply on top. A difference
    outside RESUMABLE raises UserError (one line) naming each field with the saved and the given value, unless
    allow_change. An out_dir that holds no run is refused (a typo would start a new run in the wrong place) unless
    fresh_ok (--restart-unsaved: a job controller's first attempt); a run directory without config.yaml
    (nothing to resume yet) takes the given config as is.
    """
    given = absolute_paths(load_config(path, overrides), Path.cwd())
    run_dir = Path(given.out_dir)
    if not holds_run(run_dir) and not fresh_ok:
        raise UserError(no_run_to_resume(run_dir))
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return given, {}
    saved = _saved_paths_absolute(load_config(saved_path), saved_path)
    resumed = _auto_as_saved(saved, absolute_paths(load_config(path, overrides, base=saved), Path.cwd()))
    changes = config_changes(saved, resumed)
    refused = {k: v for k, v in changes.items() if not resumable(k)}
    if refused and not allow_change:
        listed = "; ".join(f"{k}: saved {old!r}, given {new!r}" for k, (old, new) in refused.items())
        raise UserError(
            f"--resume keeps the run's config ({saved_path}), but these differ: {listed}. "
            f"A resume may change only {', '.join(RESUMABLE)}: drop the others, or pass --allow-config-change"
        )
    return resumed, changes


def _auto_as_saved(saved: RunConfig, resumed: RunConfig) -> RunConfig:
    """`resumed` with a field given as `auto` holding what auto chose at the run's start (the saved config holds the
    choice): a resume with the run's own config file (a Kubernetes job's retry) changes nothing."""
    if resumed.training.mixed_precision == "auto" and saved.training.mixed_precision != "auto":
        resumed.training.mixed_precision = saved.training.mixed_precision
    return resumed


def record_config(
    run_dir: str | Path, event: str, changes: dict[str, tuple[Any, Any]] | None = None, **extra: Any
) -> None:
    """Append one line to the run's config_history.jsonl: the event (start, resume, restart), when, what changed
    from the saved config ({key: [old, new]}) and which of those only --allow-config-change let through."""
    changes = changes or {}
    line = {
        "event": event,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "changes": {k: list(v) for k, v in changes.items()},
        "forced": sorted(k for k in changes if not resumable(k)),
        **({"cwd": os.getcwd()} if event == "start" else {}),  # what a saved config's relative paths meant
        "loopline": version(),  # which code ran (the model card names it)
        **extra,
    }
    with (Path(run_dir) / HISTORY_FILE).open("a") as f:
        f.write(json.dumps(line) + "\n")
