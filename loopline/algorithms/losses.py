"""Policy-gradient losses, KL estimators and loss aggregation: pure tensor functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["seq_mean", "token_mean", "fixed_length"]


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: Aggregation, max_len: int | None = None) -> torch.Tensor:
    """Reduce per-token values (B, T) under a 0/1 mask to a scalar.

    seq_mean:     mean over sequences of each sequence's token mean (rows with no tokens count as 0)
    token_mean:   sum over all tokens / number of tokens (0 if there are none)
    fixed_length: sum over all tokens / (B * max_len), independent of response length (Dr. GRPO)
    """
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if mode == "seq_mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.mean()
    if mode == "fixed_length":
        if not max_len:
            raise ValueError("fixed_length aggregation needs max_len")
        return masked.sum() / (values.shape[0] * max_len)
    raise ValueError(f"unknown aggregation {mode!r}; use seq_mean, token_mean or fixed_length")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: Literal["k1", "k2", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3)."""
    log_ratio = ref_logprobs - logprobs  # log(ref / pi)
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        # exp(x) - 1 - x >= 0; clamp keeps exp finite when the two policies drift far apart
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


@dataclass
class PolicyLossOutput:
    """The scalar loss and per-batch statistics for logging."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor  # k3 estimate of KL(old || new) over the masked tokens


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: Aggregation = "token_mean",
    max_len: int | None = None,
) -> PolicyLossOutput:
    """PPO/GRPO clipped surrogate: -min(r A, clip(r, 1-lo, 1+hi) A), aggregated over tokens.

    logprobs, old_logprobs, mask: (B, T); advantages: (B,) per sequence or (B, T) per token.
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1) broadcasts over tokens
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, agg, max_len)
    with torch.no_grad():
        m = mask.to(per_token.dtype)
        n = m.sum().clamp(min=1.0)
        clip_fraction = ((clipped < unclipped).to(m.dtype) * m).sum() / n
        approx_kl = ((torch.exp(-log_ratio) - 1.0 + log_ratio) * m).sum() / n
    return PolicyLossOutput(loss=loss, clip_fraction=clip_fraction, approx_kl=approx_kl)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the softmax over the last dim: (..., V) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
