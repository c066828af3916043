"""How a model's forward takes and returns its KV cache, across transformers versions and wrappers."""

from __future__ import annotations

import inspect

from torch import nn
from transformers.cache_utils import Cache


def cache_argument(model: nn.Module) -> str | None:
    """The keyword a model's forward takes its KV cache by (`cache` in newer transformers, `past_key_values`
    before), None when it takes neither; wrappers such as peft's are looked through to the model they wrap."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(inner.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def cache_of(output: object) -> Cache | None:
    """The KV cache a forward returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)
