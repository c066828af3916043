"""DAPO's data-side pieces (Yu et al., 2025), as pure tensor functions.

Clip-higher is clipped_policy_loss with clip_high > clip_low, and token-level aggregation is
aggregate(..., "token_mean") over the whole batch; what is left lives here.
"""

from __future__ import annotations

import torch


def informative_groups(rewards: torch.Tensor, group_size: int, atol: float = 0.0) -> torch.Tensor:
    """Dynamic sampling: True for groups whose rewards are not all equal, max - min > atol. (B,) -> (G,) bool.

    A group of equal rewards has zero advantage everywhere and no gradient; the loop drops it and
    samples more prompts until the batch is full. NaN rewards are not allowed.
    """
    if group_size < 1 or rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries")
    grouped = rewards.view(-1, group_size)  # (G, n)
    return (grouped.amax(dim=1) - grouped.amin(dim=1)) > atol


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, cache_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment: -penalty * clip((|y| - (L_max - L_cache)) / L_cache, 0, 1). (B,) -> (B,).

    0 up to L_max - L_cache tokens, then falls linearly to -penalty at L_max (and stays there beyond).
    Add it to the task reward.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    if not lengths.is_floating_point():
        lengths = lengths.to(torch.get_default_dtype())
    excess = (lengths - (max_len - cache_len)) / cache_len
    return -penalty * excess.clamp(0.0, 1.0)


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: zero the loss mask of rows that stopped at the length limit. (B, T), (B,) -> (B, T)."""
    return mask * (~truncated.to(torch.bool)).unsqueeze(1).to(mask.dtype)
