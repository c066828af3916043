"""`loopline export CKPT OUT`: any checkpoint as a Hugging Face model directory (safetensors).

CKPT is a checkpoint directory (RUN_DIR/checkpoints/<phase>-<step>) or a run directory (its newest
checkpoint). The weights come from the checkpoint's DCP shards, whatever number of trainer ranks wrote
them, so this works whether or not the checkpoint kept model/model.safetensors (checkpoint.hf_model). A model card
(README.md: base model, data, algorithm, final metrics, loopline version) is written beside the weights.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from loopline.checkpoint.model_card import model_card
from loopline.checkpoint.run_dir import RUN_CONFIG
from loopline.checkpoint.state import latest_checkpoint, load_weights
from loopline.config import load_config
from loopline.errors import UserError
from loopline.models.config import LoRAConfig
from loopline.models.load import DTYPES
from loopline.models.tokenizer import load_tokenizer


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory `path` names: itself, or the newest whole checkpoint of a run directory."""
    path = Path(path)
    if (path / "dcp").is_dir():
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise UserError(f"'{path}' is neither a checkpoint (no dcp/ inside) nor a run directory with one")
    return newest


def _lora_config(ckpt: Path) -> LoRAConfig | None:
    """The run's LoRA settings, if its policy trained adapters (from the checkpoint's copy of config.yaml)."""
    if not (ckpt / "config.yaml").exists():
        return None
    lora = load_config(ckpt / "config.yaml").model.lora
    return lora if lora.r else None


def export(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the policy of `checkpoint` to `out` (config, model.safetensors, tokenizer, and its model card README.md:
    checkpoint.model_card); returns `out`. dtype: the written weights' (float32, bfloat16, float16), rounded from
    the checkpoint's (float32 master weights under training.mixed_precision); None: the checkpoint's own."""
    if Path(out).exists() and not Path(out).is_dir():  # save_pretrained would only log an error and return
        raise UserError(f"export: destination '{out}' is a file: give a directory to write the model to")
    ckpt = resolve_checkpoint(checkpoint)
    config = AutoConfig.from_pretrained(ckpt / "model")
    saved = getattr(config, "dtype", None) or torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=saved)
    lora = _lora_config(ckpt)
    if lora is not None:  # the shards hold adapters beside the frozen weights: fold them in
        from loopline.training.lora import apply_lora, merged_state_dict

        apply_lora(model, lora)
    load_weights(ckpt, model)
    out = Path(out)
    if dtype is not None:
        model.to(DTYPES[dtype])  # rounds to nearest even, as the weight sync into a bf16 engine does
    weights = merged_state_dict(model) if lora is not None else None
    model.save_pretrained(out, safe_serialization=True, state_dict=weights)
    load_tokenizer(ckpt / "model").save_pretrained(out)
    if (ckpt / "config.yaml").is_file():  # what the model was trained on: `loopline eval` of it reads this
        shutil.copyfile(ckpt / "config.yaml", out / RUN_CONFIG)
    (out / "README.md").write_text(model_card(ckpt, out.resolve().name))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: loopline export CKPT OUT."""
    parser = argparse.ArgumentParser(prog="loopline export", description=__doc__, allow_abbrev=False)
    parser.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest checkpoint)")
    parser.add_argument("out", help="directory to write the Hugging Face model to")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="dtype of the written weights")
    args = parser.parse_args(argv)
    print(
        f"exported {resolve_checkpoint(args.checkpoint)} to {export(args.checkpoint, args.out, args.dtype)}"
    )
    return 0
