"""Reward-model score transforms applied before the advantages, as pure tensor functions.

A Bradley-Terry reward model's scores have no fixed scale or offset (only differences were trained),
and their tails are where the policy finds what the model never learned to reject. Whitening over the
batch gives them a known scale, so reward.model_coef weighs them against a 0/1 verifier the same way
for any reward model; clipping bounds how much one outlying score can pull the update.
"""

from __future__ import annotations

import torch


def whiten_clip(scores: torch.Tensor, clip: float | None = None, eps: float = 1e-6) -> torch.Tensor:
    """(s - mean) / (std + eps) over the batch (population std), then clamped to [-clip, clip]. (B,) -> (B,).

    A batch of one, or of equal scores, whitens to zeros (no preference to act on).
    """
    if scores.ndim != 1 or scores.numel() == 0:
        raise ValueError(f"scores must be a non-empty 1-D tensor, got shape {tuple(scores.shape)}")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    centred = scores - scores.mean()
    white = centred / (centred.pow(2).mean().sqrt() + eps)
    return white if clip is None else white.clamp(-clip, clip)
