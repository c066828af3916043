"""Models: load any HF causal LM from a local path, or build the tiny built-in one.

`load_policy` and `build_tiny_model` are imported from models.load on first use: importing this package
(as loading a config does, for models.config) must not import torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loopline.models.load import build_tiny_model, load_policy

__all__ = ["build_tiny_model", "load_policy"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from loopline.models import load

        return getattr(load, name)
    raise AttributeError(f"module 'loopline.models' has no attribute '{name}'")
