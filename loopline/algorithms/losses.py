"""Policy and value losses, KL estimators, importance weights and loss aggregation: pure tensor functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["seq_mean", "token_mean", "fixed_length"]


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: Aggregation, max_len: int | None = None
) -> torch.Tensor:
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


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: Literal["k1", "k2", "k3"]
) -> torch.Tensor:
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


def logprob_mismatch(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """How far the engine's sampled log-probs are from the trainer's for the same tokens, (B, T) each: the k3
    estimate of KL(engine || trainer) (the tokens are the engine's samples), token mean over the mask, and the
    largest |trainer - engine| on the mask. Both 0 when the two compute the same numbers."""
    m = mask.to(trainer.dtype)
    log_ratio = ((trainer - engine) * m).clamp(-20.0, 20.0)  # log(trainer / engine), 0 off the mask
    k3 = torch.exp(log_ratio) - 1.0 - log_ratio
    kl = float((k3 * m).sum() / m.sum().clamp(min=1.0))
    return kl, float(log_ratio.abs().max()) if log_ratio.numel() else 0.0


@dataclass
class PolicyLossOutput:
    """The scalar loss and per-batch statistics for logging."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor  # k3 estimate of KL(old || new) over the masked tokens


# ---------------------------------------------------------------- per-token surrogates


def ppo_clip_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2
) -> torch.Tensor:
    """PPO per-token loss -min(r A, clip(r, 1 - lo, 1 + hi) A); lo != hi is DAPO's clip-higher. (B, T)."""
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def dual_clip_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float, clip_c: float
) -> torch.Tensor:
    """Dual-clip PPO: the PPO loss, capped at -c A (c > 1) where A < 0, so a huge ratio cannot blow it up."""
    if clip_c <= 1.0:
        raise ValueError(f"dual clip needs clip_c > 1, got {clip_c}")
    per_token = ppo_clip_token_loss(ratio, advantages, clip_low, clip_high)
    return torch.where(advantages < 0, torch.minimum(per_token, -clip_c * advantages), per_token)


def truncated_is_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance weights min(exp(logp_old - logp_behaviour), C), detached; 1 off the mask. (B, T).

    old_logprobs: the trainer's log-probs of the sampled tokens before this update; behaviour_logprobs:
    those the generation engine reported (another kernel, or an older policy version in async mode).
    """
    diff = (old_logprobs - behaviour_logprobs).detach() * mask.to(old_logprobs.dtype)
    return torch.exp(diff).clamp(max=cap)


BehaviourCorrection = Literal["tis", "mask_token", "mask_seq"]


@dataclass
class BehaviourWeights:
    """Per-token weights proximal / behaviour for the policy loss, and how far the batch was off-policy."""

    weights: torch.Tensor  # (B, T), detached; 1 off the mask
    low: float  # smallest and largest raw weight on the mask (before truncating or masking)
    high: float
    mean: float
    cut_fraction: float  # share of the masked tokens truncated (tis) or zeroed (mask_token, mask_seq)


def behaviour_weights(
    proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, mode: BehaviourCorrection, cap: float
) -> BehaviourWeights:
    """Importance weights rho = exp(proximal - behaviour) for tokens sampled by another policy than the trainer's.

    proximal: the trainer's log-probs of the sampled tokens before the update (the loss ratio's denominator);
    behaviour: what the engine that sampled them reported (other kernels, or an older policy version). (B, T).
    tis: min(rho, cap). mask_token: rho where 1/cap <= rho <= cap, else 0. mask_seq: rho, with every token of a
    sequence zeroed when its geometric-mean rho (length-normalised, so the bound does not depend on length) is
    outside [1/cap, cap]. The loss still divides by the tokens as drawn: a zeroed token counts, it adds nothing.
    """
    if cap <= 1.0:
        raise ValueError(f"behaviour correction needs cap > 1, got {cap}")
    m = mask.to(proximal.dtype)
    on = m.bool()
    log_rho = (proximal - behaviour).detach() * m
    rho = torch.exp(log_rho)
    if mode == "tis":
        weights, cut = truncated_is_weights(proximal, behaviour, mask, cap), on & (rho > cap)
    elif mode == "mask_token":
        keep = (rho >= 1.0 / cap) & (rho <= cap)
        weights, cut = torch.where(keep, rho, torch.zeros_like(rho)), on & ~keep
    elif mode == "mask_seq":
        seq = torch.exp(log_rho.sum(dim=1) / m.sum(dim=1).clamp(min=1.0))  # (B,)
        keep = ((seq >= 1.0 / cap) & (seq <= cap)).unsqueeze(1)  # (B, 1)
        weights, cut = torch.where(keep, rho, torch.zeros_like(rho)), on & ~keep
    else:
        raise ValueError(f"unknown behaviour correction {mode!r}; use tis, mask_token or mask_seq")
    weights = torch.where(on, weights, torch.ones_like(weights))
    n = max(int(on.sum()), 1)
    raw = rho[on] if on.any() else torch.ones(1)
    return BehaviourWeights(
        weights, float(raw.min()), float(raw.max()), float(raw.mean()), float(cut.sum()) / n
    )


def _policy_loss_output(
    per_token: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped_away: torch.Tensor,
    mask: torch.Tensor,
    agg: Aggregation,
    max_len: int | None,
) -> PolicyLossOutput:
    """Aggregate a per-token loss and gather the statistics every policy loss reports."""
    loss = aggregate(per_token, mask, agg, max_len)
    with torch.no_grad():
        m = mask.to(per_token.dtype)
        n = m.sum().clamp(min=1.0)
        clip_fraction = (clipped_away.to(m.dtype) * m).sum() / n
        # k3 with r = new / old, the tokens sampled from old: (r - 1) - log r estimates KL(old || new)
        approx_kl = ((torch.exp(log_ratio) - 1.0 - log_ratio) * m).sum() / n
    return PolicyLossOutput(loss=loss, clip_fraction=clip_fraction, approx_kl=approx_kl)


# ---------------------------------------------------------------- policy losses


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: Aggregation = "token_mean",
    max_len: int | None = None,
    *,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO/GRPO clipped surrogate: -min(r A, clip(r, 1-lo, 1+hi) A), aggregated over tokens.

    logprobs, old_logprobs, mask: (B, T); advantages: (B,) per sequence or (B, T) per token.
    dual_clip: c > 1 caps the loss of negative-advantage tokens at -c A (dual_clip_token_loss).
    is_weights: (B, T) per-token weights multiplied in before aggregation (truncated_is_weights).
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1) broadcasts over tokens
    log_ratio = logprobs - old_logprobs  # (B, T)
    ratio = torch.exp(log_ratio)
    if dual_clip is None:
        per_token = ppo_clip_token_loss(ratio, advantages, clip_low, clip_high)
    else:
        per_token = dual_clip_token_loss(ratio, advantages, clip_low, clip_high, dual_clip)
    if is_weights is not None:
        per_token = per_token * is_weights
    with torch.no_grad():
        clipped_away = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages < ratio * advantages
    return _policy_loss_output(per_token, log_ratio, clipped_away, mask, agg, max_len)


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: Aggregation = "seq_mean",
    max_len: int | None = None,
    *,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO: PPO clip on the sequence ratio s = exp(mean_t (logp - logp_old)) over masked tokens.

    logprobs, old_logprobs, mask: (B, T); advantages: (B,). The sequence loss -min(s A, clip(s) A) is
    spread over the sequence's tokens, so with agg="seq_mean" the loss is its mean over sequences.
    Default clip range from the GSPO paper (sequence ratios stay much closer to 1 than token ratios).
    """
    m = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs  # (B, T)
    seq_log_ratio = (log_ratio * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # (B,)
    ratio = torch.exp(seq_log_ratio).unsqueeze(1)  # (B, 1)
    adv = advantages.unsqueeze(1)  # (B, 1)
    per_token = ppo_clip_token_loss(ratio, adv, clip_low, clip_high).expand_as(log_ratio)  # (B, T)
    if is_weights is not None:
        per_token = per_token * is_weights
    with torch.no_grad():
        clipped_away = (ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv < ratio * adv).expand_as(log_ratio)
    return _policy_loss_output(per_token, log_ratio, clipped_away, mask, agg, max_len)


# ---------------------------------------------------------------- critic


@dataclass
class ValueLossOutput:
    """The scalar value loss and the fraction of tokens where the clipped error was the larger."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.2,
    agg: Aggregation = "token_mean",
    max_len: int | None = None,
) -> ValueLossOutput:
    """PPO value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -e, e) - R)^2); e=None: plain 0.5 (V - R)^2.

    values (the critic now), old_values (at rollout time), returns, mask: (B, T).
    """
    unclipped = (values - returns).square()  # (B, T)
    if clip_range is None:
        per_token, clipped_away = 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clipped - returns).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_away = (clipped > unclipped).detach()
    loss = aggregate(per_token, mask, agg, max_len)
    m = mask.to(values.dtype)
    clip_fraction = (clipped_away.to(m.dtype) * m).sum() / m.sum().clamp(min=1.0)
    return ValueLossOutput(loss=loss, clip_fraction=clip_fraction)


# ---------------------------------------------------------------- entropy


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the softmax over the last dim: (..., V) -> (...)."""
    return entropy_from_logprobs(torch.log_softmax(logits.float(), dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Per-position entropy from log-probabilities over the last dim (a log_softmax the caller already has)."""
    return -(logp.exp() * logp).sum(dim=-1)
