"""Checkpoints: everything a run needs to continue, written atomically (tmp dir, then rename).

Layout of RUN_DIR/checkpoints/<phase>-<step>/:
  dcp/          model, optimizer and LR schedule: torch.distributed.checkpoint, one shard file per trainer rank
  reference/    (RL with kl_coef > 0) the frozen reference policy, sharded like dcp/; it never changes within
                a phase, so after the first save of a process the files are hard links to the previous one's
  reward/       (`loopline rm`) the reward model's weights, optimizer and LR schedule, sharded like dcp/
  loop.pt       (RL) the loop's own state: KL controller, critic (weights, optimizer, LR schedule), the engines'
                sampling generators
  model/        config and tokenizer of the policy, and (checkpoint.hf_model) its weights as model.safetensors:
                a Hugging Face directory; `loopline export` makes one from any checkpoint
  state.json    RunState: phase, step, policy version, sampler position
  rng.pt        python, numpy and torch RNG states of the driver (the local engine samples from torch's)
  cursors.json  byte lengths of metrics.jsonl and ledger.jsonl when it was taken; a resume cuts them back
  config.yaml   the run's config
RUN_DIR/checkpoints/latest names the newest whole checkpoint; it is a hint for people and tools: a resume scans
the checkpoint directories itself (a kill between a rename and the pointer's update, or a lost pointer, must
not hide a whole checkpoint).

A checkpoint is written under `.tmp-<name>` and renamed when whole, then `latest` is replaced (a rename
too), so a checkpoint that exists is complete and `latest` never names a partial one: a process killed
at any moment leaves the previous checkpoint as the newest. With checkpoint.async_save the state is
copied at the save call and written by a background thread while training continues; the next save (and
the end of the run) waits for it, and it becomes `latest` only once whole.

A resume takes the newest checkpoint whose files all read whole (checkpoint_fault): a damaged one (a disk
that filled up, a copy cut short) is skipped, named with the file at fault, and the one before it is used.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loopline.checkpoint.config import CheckpointConfig
from loopline.checkpoint.dcp import copy_state, read_model_weights
from loopline.checkpoint.faults import FAULTS
from loopline.checkpoint.ledger import LEDGER_FILE
from loopline.distributed.workers import WorkerError
from loopline.errors import UserError

# Append-only run files that a checkpoint records the length of, and a resume cuts back to that length.
RUN_FILES = ("metrics.jsonl", LEDGER_FILE)


@dataclass
class RunState:
    """The controller's state: where the run is. Everything else is derived from the config."""

    phase: str = "sft"  # "sft" or "grpo": the phase this state belongs to
    step: int = 0  # optimizer steps completed in this phase
    sampler: dict[str, int] = field(default_factory=dict)
    policy_version: int = 0  # the version of the weights the engines hold (RL: one per step)
    done: bool = False  # the phase ended before its last step (it reached sft/grpo.stop_at_accuracy)
    val_accuracy: float = 0.0  # the phase's last validation check (SFT: every step near the target)


@dataclass
class LoopState:
    """The RL loop's own state beyond the policy (loop.pt): what a resumed phase restores to continue exactly.

    On disk it is the plain dict to_dict() makes (the keys "kl", "engine_rng", with a critic "critic", with
    batches generated ahead "buffer", for DPO "dpo", for the reward model "rm"), as
    every loopline has written it; from_dict() reads any of them (a key the writer lacked reads as absent).
    """

    kl: dict[str, float] | None = None  # the KL controller's state_dict() (None: the checkpoint has none)
    engine_rng: list[Any] = field(default_factory=list)  # each engine's sampling generator state, by rank
    critic: dict[str, Any] | None = (
        None  # local: the critic's whole state; ray: {"dcp": its shards' dir name}
    )
    # grpo.max_staleness >= 1: the batches generated but not yet trained (loops.grpo.Scored), oldest first
    buffer: list[Any] = field(default_factory=list)
    # DPO: the pairs it trains and scores on and their reference log-probs (loops.preference.train_dpo)
    dpo: dict[str, Any] | None = None
    # the reward model: the pairs it trains and scores on (loops.preference.train_rm)
    rm: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The loop.pt form."""
        out: dict[str, Any] = {"kl": self.kl, "engine_rng": self.engine_rng}
        if self.critic is not None:
            out["critic"] = self.critic
        if self.buffer:
            out["buffer"] = self.buffer
        if self.dpo is not None:
            out["dpo"] = self.dpo
        if self.rm is not None:
            out["rm"] = self.rm
        return out

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> LoopState:
        return cls(
            kl=saved.get("kl"),
            engine_rng=saved.get("engine_rng", []),
            critic=saved.get("critic"),
            buffer=saved.get("buffer", []),
            dpo=saved.get("dpo"),
            rm=saved.get("rm"),
        )


@dataclass(frozen=True)
class CheckpointParts:
    """Where a resumed phase finds its parts in the checkpoint it resumes from (Checkpointer.resume)."""

    dcp: (
        str  # the policy's model, optimizer and LR-schedule shards (Actor.start_phase restores the optimizer)
    )
    reference: str | None = None  # the frozen reference's shards, where the run has one
    loop: str | None = None  # loop.pt (LoopState), where the phase wrote one
    reward: str | None = (
        None  # the reward model's shards (weights, optimizer, LR schedule), in an rm checkpoint
    )

    @property
    def checkpoint(self) -> str:
        """The checkpoint's directory (the critic's shards are in it, beside dcp/)."""
        return str(Path(self.dcp).parent)


class CheckpointActor(Protocol):
    """What checkpoints need from the actor role (runtime.protocols.Actor): every trainer rank saves its own shards."""

    def save_state(
        self, path: str, hf_dir: str | None, blocking: bool = True, reference: str | None = None
    ) -> None: ...

    def wait_saved(self, timeout_s: float) -> None: ...

    def load_state(self, path: str) -> None: ...


LOOP_FILE = "loop.pt"
REFERENCE_DIR = "reference"
REWARD_DIR = "reward"  # `loopline rm`: the reward model's DCP shards, beside dcp/ (the policy's, unchanged)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_name(state: RunState) -> str:
    return f"{state.phase}-{state.step:06d}"


_CHECKPOINT_NAME = re.compile(r"[a-z_]+-\d+")  # checkpoint_name(); not .tmp-*, .trash-* or `latest`


def checkpoints_newest_first(run_dir: str | Path) -> list[Path]:
    """A run's checkpoint directories, newest first. Each was renamed into place when whole, so each is a
    checkpoint; whether its files are intact is checkpoint_fault's question."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _CHECKPOINT_NAME.fullmatch(p.name)]
    return sorted(found, key=_age_key, reverse=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run, or None (found by name: the `latest` pointer is a hint only)."""
    found = checkpoints_newest_first(run_dir)
    return found[0] if found else None


def _age_key(path: Path) -> tuple[int, str]:
    """Oldest first: SFT checkpoints precede RL ones (by name alone 'grpo-*' would sort before 'sft-*')."""
    phase = path.name.split("-", 1)[0]
    return ({"sft": 0, "grpo": 1}.get(phase, 2), path.name)


def _shards_fault(shards: Path) -> str | None:
    """Why the DCP directory `shards` is not whole (a missing or short shard file), or None. DCP keeps no
    checksums: a shard of the right length with bad bytes shows only when it is loaded."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(shards)).read_metadata()
    except Exception as e:
        return f"{shards.name}/.metadata: {type(e).__name__}: {e}"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = shards / name
        if not path.is_file():
            return f"{shards.name}/{name}: missing"
        if path.stat().st_size < size:
            return f"{shards.name}/{name}: truncated ({path.stat().st_size} of {size} bytes)"
    return None


def checkpoint_fault(path: Path) -> str | None:
    """Why checkpoint `path` cannot be resumed from, starting with the file at fault ("loop.pt: EOFError: ..."),
    or None when every file a resume reads is there and reads whole."""

    def read_json(name: str) -> Any:
        return json.loads((path / name).read_text())

    def read_torch(name: str) -> Any:
        return torch.load(path / name, weights_only=False)

    checks: list[tuple[str, Callable[[], object]]] = [
        ("state.json", lambda: RunState(**read_json("state.json"))),
        ("cursors.json", lambda: dict(read_json("cursors.json"))),
        ("rng.pt", lambda: [read_torch("rng.pt")[k] for k in ("python", "numpy", "torch")]),
    ]
    if (path / LOOP_FILE).exists():
        checks.append((LOOP_FILE, functools.partial(read_torch, LOOP_FILE)))
    for name, check in checks:
        try:
            check()
        except Exception as e:
            return f"{name}: {type(e).__name__}: {e}"
    # dcp/ (the actor's shards) always; reference/ and the ray critic's critic/ where the checkpoint has them
    shard_dirs = {path / "dcp"} | {p for p in path.iterdir() if p.is_dir() and (p / ".metadata").exists()}
    for shards in sorted(shard_dirs):
        fault = _shards_fault(shards)
        if fault:
            return fault
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: str) -> None:
    with path.open("w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _begin(root: Path, name: str) -> Path:
    """A clean `.tmp-<name>` directory to write checkpoint <name> into."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _write_small_files(tmp: Path, state: RunState, run_dir: Path) -> None:
    """state.json, rng.pt, cursors.json and the run's config.yaml: taken at the save call."""
    torch.save(rng_state(), tmp / "rng.pt")
    if (run_dir / "config.yaml").exists():  # how the model was built (e.g. LoRA adapters): export reads it
        shutil.copyfile(run_dir / "config.yaml", tmp / "config.yaml")
    _write_file(tmp / "state.json", json.dumps(asdict(state)))
    cursors = {name: (run_dir / name).stat().st_size for name in RUN_FILES if (run_dir / name).exists()}
    _write_file(tmp / "cursors.json", json.dumps(cursors))


def _write_model_dir(tmp: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """model/: the policy's config, generation config and tokenizer (the weights come from the actor)."""
    out = tmp / "model"
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _commit(root: Path, tmp: Path, name: str, keep_last: int) -> Path:
    """Rename the whole checkpoint into place, point `latest` at it, prune to keep_last."""
    final, trash = root / name, root / f".trash-{name}"
    if final.exists():  # a stale copy of this step from a run that was killed before naming it latest
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer_tmp = root / ".latest.tmp"
    _write_file(pointer_tmp, name)
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)
    shutil.rmtree(trash, ignore_errors=True)
    whole = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=_age_key)
    for old in whole[:-keep_last] if keep_last > 0 else []:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    FAULTS.pause_point(f"saved:{name}")  # test hook: a kill right after a save
    return final


def _link_tree(src: Path, dst: Path) -> None:
    """dst as a copy of the flat directory src: hard links where the filesystem allows (no bytes written)."""
    dst.mkdir()
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


def truncate_run_files(run_dir: Path, cursors: dict[str, int]) -> None:
    """Cut each append-only run file back to its length at the checkpoint: rows of later steps go."""
    for name in RUN_FILES:
        path = run_dir / name
        if not path.exists():
            continue
        keep = cursors.get(name, 0)
        if path.stat().st_size > keep:
            with path.open("r+b") as f:
                f.truncate(keep)


class SaveInFlight:
    """The checkpoint being finished in the background (checkpoint.async_save), at most one: its failure is raised
    by the next wait() (a lost rank's WorkerError as it is, for the run's recovery), or dropped by abandon() when
    the ranks writing it were lost (a restart, a heal)."""

    def __init__(self, timeout_s: float) -> None:
        """timeout_s: checkpoint.save_timeout_s, the longest a save's finish waits for the ranks' shards."""
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, finish: Callable[[], None], name: str) -> None:
        """Run `finish` in a thread (the caller wait()ed for the one before)."""
        self._thread = threading.Thread(target=self._catch, args=(finish,), name=name, daemon=True)
        self._thread.start()

    def run(self, finish: Callable[[], None]) -> None:
        """Run `finish` here (a blocking save), raising its failure as wait() would."""
        self._catch(finish)
        self._raise()

    def _catch(self, finish: Callable[[], None]) -> None:
        try:
            finish()
        except BaseException as e:  # raised by the next wait() in the loop's thread
            self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, WorkerError):  # a rank lost under the save: recovered as any call's failure
                raise error
            raise RuntimeError(f"checkpoint failed: {type(error).__name__}: {error}") from error

    def wait(self) -> None:
        """Wait for the save in flight to become `latest`; raise if it failed or outlived its timeout."""
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s + 5.0)  # the finish itself waits at most timeout_s for the shards
            if thread.is_alive():
                raise TimeoutError(f"stage 'checkpoint': the save did not finish within {self.timeout_s:g}s")
            self._thread = None
        self._raise()

    def abandon(self) -> None:
        """Let the save in flight end (bounded) and drop its error: it is `latest` only if it became whole."""
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s + 5.0)
        self._thread, self._error = None, None


class Checkpointer:
    """Saves a run's checkpoints through its actor (each trainer rank writes its own shards) and resumes from them."""

    def __init__(
        self,
        run_dir: str | Path,
        cfg: CheckpointConfig,
        actor: CheckpointActor,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        in_flight: SaveInFlight | None = None,
    ) -> None:
        """in_flight: the background save, when something built before this checkpointer (a trainer that heals)
        must be able to drop it; else one of its own."""
        self.run_dir, self.cfg, self.actor = Path(run_dir), cfg, actor
        self.model, self.tokenizer = model, tokenizer  # for the config and tokenizer files only
        self.root = checkpoint_root(run_dir)
        self.in_flight = in_flight if in_flight is not None else SaveInFlight(cfg.save_timeout_s)
        self.last_save_s = 0.0  # wall time the last save() blocked the caller
        self.resumed_from: Path | None = None
        self.skipped: list[tuple[Path, str]] = []  # checkpoints the last resume() passed over, and why
        # the frozen reference of this phase as a whole checkpoint holds it: later saves link its files
        self._reference: Path | None = None

    def save(self, state: RunState, loop_state: LoopState | None = None, reference: bool = False) -> None:
        """Checkpoint `state` and the actor's model, optimizer and LR schedule: blocking, or in the background.

        loop_state: the loop's own state (tensors are copied now), read back by load_loop_state on resume.
        reference: also the actor's frozen reference (written once per process, then linked from the last save).
        """
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight
        name = checkpoint_name(state)
        tmp = _begin(self.root, name)
        _write_small_files(tmp, state, self.run_dir)
        model_dir = _write_model_dir(tmp, self.model, self.tokenizer)
        hf_dir = str(model_dir) if self.cfg.hf_model else None
        write_reference = None
        if reference and self._reference is not None and self._reference.is_dir():
            _link_tree(self._reference, tmp / REFERENCE_DIR)
        elif reference:
            write_reference = str(tmp / REFERENCE_DIR)
        self.actor.save_state(
            str(tmp / "dcp"), hf_dir, blocking=not self.cfg.async_save, reference=write_reference
        )
        # as it is now (training goes on), in its file form
        staged = copy_state(loop_state.to_dict()) if loop_state is not None else None
        finish = functools.partial(self._finish, tmp, name, staged, reference)
        if self.cfg.async_save:
            self.in_flight.start(finish, f"checkpoint-{name}")
        else:
            self.in_flight.run(finish)
        self.last_save_s = time.perf_counter() - t0

    def _finish(self, tmp: Path, name: str, loop_state: dict[str, Any] | None, reference: bool) -> None:
        if loop_state is not None:
            torch.save(loop_state, tmp / LOOP_FILE)
        self.actor.wait_saved(self.cfg.save_timeout_s)
        final = _commit(self.root, tmp, name, self.cfg.keep_last)
        self._reference = final / REFERENCE_DIR if reference else None

    def wait(self) -> None:
        """Wait (at most checkpoint.save_timeout_s) for the save in flight to become `latest`; raise if it failed."""
        self.in_flight.wait()

    def abandon(self) -> None:
        """After the roles failed: let the save in flight end (bounded) and drop its error; it is `latest` only
        if it became whole."""
        self.in_flight.abandon()

    def resume(self) -> tuple[RunState, CheckpointParts] | None:
        """Restore the newest checkpoint whose files read whole: weights on every trainer rank, RNG, run files cut
        back. Damaged newer ones are passed over (self.skipped: path and the file at fault).

        Returns (run state, where its parts are for Actor.start_phase and the loop), or None when there is no checkpoint; raises
        UserError when there are checkpoints and none is whole (the run files are left as they are).
        """
        for pattern in (".tmp-*", ".trash-*"):  # what killed saves left behind
            for leftover in self.root.glob(pattern):
                shutil.rmtree(leftover, ignore_errors=True)
        # every file of the checkpoint read before anything is loaded or cut back
        path, self.skipped = newest_whole_checkpoint(self.run_dir)
        if path is None:
            return None
        state = RunState(**json.loads((path / "state.json").read_text()))
        self.actor.load_state(str(path / "dcp"))
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        truncate_run_files(self.run_dir, json.loads((path / "cursors.json").read_text()))
        self.resumed_from = path
        self._reference = path / REFERENCE_DIR if (path / REFERENCE_DIR).is_dir() else None
        return state, _parts(path)


def newest_whole_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint of a run whose files read whole (checkpoint_fault), and the newer ones passed over
    with the fault of each; (None, []) when the run has no checkpoint. Raises UserError when it has checkpoints
    and every one is damaged."""
    skipped: list[tuple[Path, str]] = []
    for path in checkpoints_newest_first(run_dir):
        fault = checkpoint_fault(path)
        if fault is None:
            return path, skipped
        skipped.append((path, fault))
    if skipped:
        faults = "; ".join(f"{path} ({fault})" for path, fault in skipped)
        raise UserError(
            f"no checkpoint of {run_dir} can be resumed from, every one is damaged: {faults}. The run's files are "
            "left as they are; restore a checkpoint, or start afresh with --overwrite"
        )
    return None, []


def load_weights(path: str | Path, model: PreTrainedModel) -> None:
    """Load the weights of checkpoint `path` (written by any number of trainer ranks) into `model`."""
    read_model_weights(Path(path) / "dcp", model)


def _parts(path: Path) -> CheckpointParts:
    """The parts of checkpoint `path` a resumed phase reads: the reference and loop.pt where it has them."""
    reference, loop, reward = path / REFERENCE_DIR, path / LOOP_FILE, path / REWARD_DIR
    return CheckpointParts(
        dcp=str(path / "dcp"),
        reference=str(reference) if reference.is_dir() else None,
        loop=str(loop) if loop.is_file() else None,
        reward=str(reward) if reward.is_dir() else None,
    )


def load_loop_state(parts: CheckpointParts | None) -> LoopState:
    """The loop state a resumed phase's checkpoint holds (Checkpointer.save's loop_state); empty if none."""
    if parts is None or parts.loop is None:
        return LoopState()
    return LoopState.from_dict(torch.load(parts.loop, weights_only=False))
