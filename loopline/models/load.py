"""Load a policy (model + tokenizer) from a local HF directory, or build the built-in one."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from loopline.errors import UserError
from loopline.models.config import ModelConfig, TinyModelConfig, missing_tokenizer
from loopline.models.tokenizer import build_byte_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> Qwen2ForCausalLM:
    """A small Qwen2 built from a config, initialised from `seed` (same seed, same weights)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
    )
    devnull_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    torch.random.set_rng_state(devnull_state)  # building a model must not move the caller's RNG
    return model


def load_policy(cfg: ModelConfig, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer a run trains: cfg.path if set, else the built-in tiny model."""
    if cfg.path:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise UserError(f"model.path '{path}' is not a Hugging Face model directory (no config.json)")
        if missing_tokenizer(path):
            raise UserError(missing_tokenizer(path))
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype])
    else:
        tokenizer = build_byte_tokenizer()
        model = build_tiny_model(cfg.tiny, tokenizer, seed).to(DTYPES[cfg.dtype])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
