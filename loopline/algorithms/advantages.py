"""Advantage estimators: pure tensor functions, no I/O, no distributed calls.

Shapes: B sequences, T response positions, G prompt groups of n samples each (B = G * n, the n samples
of a prompt contiguous). `mask` is the 0/1 response mask (B, T): 1 on tokens the policy produced.

Outcome-reward estimators (GRPO, Dr. GRPO, RLOO) return one advantage per sequence (B,); the token-level
ones (REINFORCE++, GAE) return (B, T), zero wherever the mask is 0.
"""

from __future__ import annotations

from typing import Literal

import torch

from loopline.algorithms.kl import kl_penalty_rewards


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) -> (G, n), checking that B is a multiple of the group size."""
    if group_size < 1 or rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries")
    return rewards.view(-1, group_size)


# ---------------------------------------------------------------- outcome rewards, one value per sequence


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
    grouped = _grouped(rewards, group_size)  # (G, n)
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


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO advantages: A_i = r_i - mean_group(r), no std division. (B,) -> (B,).

    The other half of Dr. GRPO is the length-independent loss: aggregate(..., "fixed_length").
    """
    return group_advantages(rewards, group_size, scale="none")


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages: A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r)). (B,) -> (B,)."""
    if group_size < 2:
        raise ValueError("RLOO needs group_size >= 2: the baseline is the mean of the other samples")
    grouped = _grouped(rewards, group_size)  # (G, n)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # (G, n) leave-one-out means
    return (grouped - others).reshape(-1)


# ---------------------------------------------------------------- token-level helpers


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) with mean and population std over the masked entries; 0 off the mask."""
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1.0)
    mean = (values * m).sum() / n
    var = ((values - mean).square() * m).sum() / n
    return (values - mean) / (var.sqrt() + eps) * m


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Returns-to-go G_t = r_t + gamma * G_{t'} over masked tokens (t' the next masked token). (B, T) -> (B, T).

    Positions off the mask (padding, tool output inside a multi-turn response) carry no reward and are
    skipped by the discount: gamma counts only the policy's own tokens. Their return is reported as 0.
    """
    m = mask.to(torch.bool)
    r = rewards * m
    running = rewards.new_zeros(rewards.shape[0])  # (B,)
    returns = torch.zeros_like(rewards)
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * m


# ---------------------------------------------------------------- REINFORCE++


def reinforce_pp_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++: A = whiten(returns-to-go of r_t), r_t = -kl_coef * kl_t (+ score on the last token).

    scores: (B,) outcome reward per sequence; mask, kl: (B, T) (kl e.g. kl_estimate(..., "k1")).
    Normalised over all masked tokens of the batch. Returns (B, T), 0 off the mask.
    """
    rewards = kl_penalty_rewards(scores, mask, kl, kl_coef)  # (B, T)
    returns = discounted_returns(rewards, mask, gamma)  # (B, T)
    return masked_whiten(returns, mask, eps)


def reinforce_pp_baseline_advantages(
    scores: torch.Tensor,
    group_size: int,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++-baseline: REINFORCE++ on scores minus their group mean, s_i - mean_group(s). (B, T)."""
    centred = dr_grpo_advantages(scores, group_size)  # (B,)
    return reinforce_pp_advantages(centred, mask, kl, kl_coef, gamma, eps)


# ---------------------------------------------------------------- GAE with a critic


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: delta_t = r_t + gamma V_{t'} - V_t, A_t = delta_t + gamma lam A_{t'}; returns R_t = A_t + V_t.

    rewards, values, mask: (B, T); t' is the next masked token, and after the last one V = A = 0
    (the response ends the episode). Off-mask positions are skipped and get A = R = 0.
    Returns (advantages, returns), each (B, T); whitening the advantages is left to the caller.
    """
    m = mask.to(torch.bool)
    next_value = values.new_zeros(values.shape[0])  # (B,)
    next_adv = values.new_zeros(values.shape[0])  # (B,)
    advantages = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(m[:, t], adv, next_adv)
        next_value = torch.where(m[:, t], values[:, t], next_value)
        advantages[:, t] = next_adv
    advantages = advantages * m
    returns = (advantages + values) * m
    return advantages, returns
