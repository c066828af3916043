"""Offline preference losses: DPO and its variants, and the Bradley-Terry reward-model loss.

DPO inputs are summed log-probs of whole completions, (B,) each: the policy's and the frozen
reference's, for the chosen and the rejected completion of each pair. Write
    delta = (logp_c - ref_c) - (logp_r - ref_r)
and beta for the strength of the implicit KL constraint. Every DPO loss returns the batch-mean loss
and the implicit rewards beta * (logp - ref) of both completions (detached, for logging).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PreferenceLossOutput(NamedTuple):
    """Scalar loss and the implicit rewards beta * (logp - ref_logp) of each completion, (B,) each."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _output(
    per_pair: torch.Tensor, chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float
) -> PreferenceLossOutput:
    return PreferenceLossOutput(
        per_pair.mean(), beta * chosen_logratios.detach(), beta * rejected_logratios.detach()
    )


def dpo_sigmoid_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> PreferenceLossOutput:
    """DPO: -(1 - e) logsigmoid(beta delta) - e logsigmoid(-beta delta); e > 0 is conservative DPO (cDPO)."""
    chosen = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected = policy_rejected_logps - ref_rejected_logps  # (B,)
    logits = beta * (chosen - rejected)
    per_pair = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return _output(per_pair, chosen, rejected, beta)


def dpo_robust_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> PreferenceLossOutput:
    """Robust DPO (labels flipped with probability e): [-(1-e) logsig(beta delta) + e logsig(-beta delta)] / (1-2e)."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    chosen = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected = policy_rejected_logps - ref_rejected_logps  # (B,)
    logits = beta * (chosen - rejected)
    per_pair = (-(1.0 - label_smoothing) * F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)) / (
        1.0 - 2.0 * label_smoothing
    )
    return _output(per_pair, chosen, rejected, beta)


def dpo_hinge_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
) -> PreferenceLossOutput:
    """SLiC-style hinge: relu(1 - beta delta)."""
    chosen = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected = policy_rejected_logps - ref_rejected_logps  # (B,)
    per_pair = torch.relu(1.0 - beta * (chosen - rejected))
    return _output(per_pair, chosen, rejected, beta)


def dpo_ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float = 0.1,
) -> PreferenceLossOutput:
    """IPO on per-token log-ratios: ((dc / |c| - dr / |r|) - 1 / (2 beta))^2, lengths clamped to >= 1.

    Length normalisation keeps the squared loss (and beta) comparable across completion lengths; the
    reported rewards are the unnormalised beta * (logp - ref), as for the other losses.
    """
    chosen = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected = policy_rejected_logps - ref_rejected_logps  # (B,)
    c_len = chosen_lengths.to(chosen.dtype).clamp(min=1.0)
    r_len = rejected_lengths.to(rejected.dtype).clamp(min=1.0)
    per_pair = (chosen / c_len - rejected / r_len - 1.0 / (2.0 * beta)).square()
    return _output(per_pair, chosen, rejected, beta)


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """Reward-model loss: mean(-logsigmoid(r_c - r_r - margin)) + center_coef * mean((r_c + r_r)^2).

    chosen_rewards, rejected_rewards, margin: (B,). The centring term pulls the rewards' mean to 0,
    which the pairwise term alone leaves free.
    """
    diff = chosen_rewards - rejected_rewards  # (B,)
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * (chosen_rewards + rejected_rewards).square().mean()
    return loss
