"""Checkpoints: everything a run needs to continue, written atomically (tmp dir, then rename).

Layout of RUN_DIR/checkpoints/<phase>-<step>/:
  model/       the policy as a Hugging Face directory (safetensors; transformers loads it)
  trainer.pt   optimizer and LR-scheduler state
  state.json   phase, step, sampler position
  rng.pt       python, numpy and torch RNG states (engine sampling draws from torch's)
RUN_DIR/checkpoints/latest names the newest whole checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class RunState:
    """The controller's state: where the run is. Everything else is derived from the config."""

    phase: str = "sft"  # "sft" or "grpo": the phase this state belongs to
    step: int = 0  # optimizer steps completed in this phase
    sampler: dict[str, int] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path,
    state: RunState,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    trainer_state: dict[str, Any],
    keep_last: int = 3,
) -> Path:
    """Write a whole checkpoint under a temporary name, rename it, then point `latest` at it."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{state.phase}-{state.step:06d}"
    final, tmp = root / name, root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(trainer_state, tmp / "trainer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state)))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(name)
    os.replace(latest_tmp, root / "latest")
    whole = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=_age_key)
    for old in whole[:-keep_last] if keep_last > 0 else []:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _age_key(path: Path) -> tuple[int, str]:
    """Oldest first: SFT checkpoints precede RL ones (by name alone 'grpo-*' would sort before 'sft-*')."""
    phase = path.name.split("-", 1)[0]
    return ({"sft": 0, "grpo": 1}.get(phase, 2), path.name)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest whole checkpoint of a run, or None."""
    pointer = checkpoint_root(run_dir) / "latest"
    if not pointer.exists():
        return None
    path = checkpoint_root(run_dir) / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(path: Path, model: PreTrainedModel) -> tuple[RunState, dict[str, Any], dict[str, Any]]:
    """Load weights into `model`; return (run state, trainer state, rng state)."""
    weights = load_file(str(path / "model" / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # tied embeddings are saved once; anything else missing means a mismatched model
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    state = RunState(**json.loads((path / "state.json").read_text()))
    trainer_state = torch.load(path / "trainer.pt", weights_only=False)
    rng = torch.load(path / "rng.pt", weights_only=False)
    return state, trainer_state, rng
