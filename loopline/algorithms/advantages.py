"""Advantage estimators: pure tensor functions, no I/O, no distributed calls."""

from __future__ import annotations

from typing import Literal

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, optionally divided by a std (+ eps).

    rewards: (B,) with the `group_size` samples of a prompt contiguous. Returns (B,).
    Std uses Bessel's correction (as TRL does). A group whose rewards are all equal gets 0.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries")
    grouped = rewards.view(-1, group_size)  # (G, n)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        centred = centred / (std + eps)
    elif scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        centred = centred / (std + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    return centred.reshape(-1)
