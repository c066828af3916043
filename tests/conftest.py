"""Shared fixtures: the byte tokenizer and a built-in model shrunk further so unit tests stay fast."""

from __future__ import annotations

import pytest
import torch

from loopline.config import TinyModelConfig
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer

# The models here are tiny: one thread is as fast as two, and does not fight the other test process
# on a 2-core machine (oversubscribed, the same tests run 5-10x slower).
torch.set_num_threads(1)

# Smaller than the default built-in model; same architecture (Qwen2 with GQA and tied embeddings).
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="session")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def small_cfg() -> TinyModelConfig:
    return SMALL


@pytest.fixture
def small_model(tokenizer):
    """A fresh, randomly initialised small model (seed 0) per test."""
    return build_tiny_model(SMALL, tokenizer, seed=0)
