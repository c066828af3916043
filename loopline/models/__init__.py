"""Models: load any HF causal LM from a local path, or build the tiny built-in one."""

from loopline.models.load import build_tiny_model, load_policy

__all__ = ["build_tiny_model", "load_policy"]
