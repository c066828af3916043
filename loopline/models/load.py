"""Load a policy (model + tokenizer): from a local HF directory, built from a real model's shape with random
weights (model.init=random: a preset, a config.json, or model.path's config), or the built-in tiny one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from loopline.errors import UserError
from loopline.models.config import ModelConfig, TinyModelConfig, missing_tokenizer
from loopline.models.presets import PRESETS
from loopline.models.tokenizer import BPE_TRAINED, bpe_tokenizer, build_byte_tokenizer, load_tokenizer

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


def cast_parameters(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """`model` with its floating-point parameters in `dtype` (in place; tied ones stay tied). Buffers keep theirs, as
    FSDP2's mixed precision keeps them: the rotary frequencies stay float32, as in the trainer's forward."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.dtype != DTYPES[dtype]:
                param.data = param.data.to(DTYPES[dtype])
    return model


def shape_config(cfg: ModelConfig) -> PretrainedConfig:
    """The Hugging Face config model.init=random builds: model.preset's published numbers, or the config.json
    in model.config (or model.path). UserError naming the field when it is not a causal LM's."""
    if cfg.preset:
        fields = dict(PRESETS[cfg.preset])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    key, where = ("model.config", cfg.config) if cfg.config else ("model.path", cfg.path)
    path = Path(where) / "config.json"
    if not path.is_file():
        raise UserError(f"{key}: '{where}' holds no config.json (a Hugging Face model config)")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise UserError(f"{key}: '{path}' is not a JSON object ({e})") from None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"{key}: '{path}' has model_type {model_type!r}, not a causal LM's (AutoModelForCausalLM builds none)"
        )
    return AutoConfig.from_pretrained(where)


def _random_model(cfg: ModelConfig, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """model.init=random: the config's architecture, weights drawn from `seed`, and a tokenizer that fits its
    vocabulary (model.tokenizer, model.path's own, or the BPE trained here padded to vocab_size)."""
    config = shape_config(cfg)
    key = "model.preset" if cfg.preset else "model.config" if cfg.config else "model.path"
    source = cfg.tokenizer or (
        cfg.path if cfg.path and (Path(cfg.path) / "tokenizer_config.json").is_file() else ""
    )
    tokenizer = load_tokenizer(source) if source else None
    needed = len(tokenizer) if tokenizer is not None else BPE_TRAINED
    if needed > config.vocab_size:
        raise UserError(
            f"{key}: vocab_size {config.vocab_size} is smaller than the tokenizer's {needed} tokens "
            f"({source or 'the BPE trained here'}): give a vocab_size of at least {needed}"
        )
    if tokenizer is None:
        tokenizer = bpe_tokenizer(config.vocab_size)
    if not source:  # the trained tokenizer's ids, not those of the real model's tokenizer
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype], attn_implementation="sdpa")
    torch.random.set_rng_state(state)  # building a model must not move the caller's RNG
    return model, tokenizer


def load_policy(cfg: ModelConfig, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer a run trains: random weights in a real shape (model.init=random), cfg.path's
    weights if set, else the built-in tiny model."""
    if cfg.init == "random":
        model, tokenizer = _random_model(cfg, seed)
    elif cfg.path:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise UserError(f"model.path '{path}' is not a Hugging Face model directory (no config.json)")
        if not cfg.tokenizer and missing_tokenizer(path):
            raise UserError(missing_tokenizer(path))
        tokenizer = load_tokenizer(cfg.tokenizer or path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype])
    else:
        tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else build_byte_tokenizer()
        model = build_tiny_model(cfg.tiny, tokenizer, seed).to(DTYPES[cfg.dtype])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
