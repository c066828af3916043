"""The scaled-down mixture-of-experts presets as models, without training a tokenizer: built from the preset's
config with seeded random weights, token ids set to the byte tokenizer's (its 259 tokens fit their 1,024)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from loopline.models.config import ModelConfig
from loopline.models.load import shape_config


def tiny_moe(preset: str = "qwen3-moe-tiny", seed: int = 0, **fields: object) -> PreTrainedModel:
    """`preset`'s architecture (fields override its config), seeded weights, pad/bos/eos = 0/1/2, train mode."""
    config = shape_config(ModelConfig(init="random", preset=preset))
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    for key, value in fields.items():
        setattr(config, key, value)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    torch.random.set_rng_state(state)
    return model.train()
