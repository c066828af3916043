"""Advantage estimators as the RL loop uses them, chosen once by `grpo.advantage`.

Each entry adapts one pure function of loopline.algorithms.advantages to a common signature:
(Signals, GRPOConfig) -> (advantages, returns). Advantages are (B,) per sequence or (B, C) per token;
returns are the critic's regression targets (B, C) for gae, None otherwise.

KL in the reward (grpo.kl_in=reward): the token-level estimators (reinforce_pp*, gae) put -kl_coef * kl_t
on every token and the score on the last one; the outcome estimators (grpo, dr_grpo, rloo) take the
sequence's sum of those, score - kl_coef * sum_t kl_t, as its reward (as verl does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loopline.algorithms.advantages import (
    dr_grpo_advantages,
    gae_advantages,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from loopline.algorithms.kl import kl_penalty_rewards
from loopline.training.config import GRPOConfig


@dataclass
class Signals:
    """What an estimator may use, for B completions of C response positions."""

    scores: torch.Tensor  # (B,) reward per completion (verifier, shaping, reward model)
    mask: torch.Tensor  # (B, C) 1 on trained tokens
    kl: torch.Tensor | None = None  # (B, C) per-token KL to the reference, when it goes into the reward
    kl_coef: float = 0.0
    values: torch.Tensor | None = None  # (B, C) critic values at rollout time (gae)


Estimate = tuple[torch.Tensor, torch.Tensor | None]


def _sequence_rewards(s: Signals) -> torch.Tensor:
    """score - kl_coef * sum_t kl_t over the trained tokens, (B,)."""
    if s.kl is None or not s.kl_coef:
        return s.scores
    return s.scores - s.kl_coef * (s.kl * s.mask).sum(dim=1)


def _grpo(s: Signals, cfg: GRPOConfig) -> Estimate:
    return group_advantages(_sequence_rewards(s), cfg.group_size, cfg.adv_scale, cfg.adv_eps), None


def _dr_grpo(s: Signals, cfg: GRPOConfig) -> Estimate:
    return dr_grpo_advantages(_sequence_rewards(s), cfg.group_size), None


def _rloo(s: Signals, cfg: GRPOConfig) -> Estimate:
    return rloo_advantages(_sequence_rewards(s), cfg.group_size), None


def _reinforce_pp(s: Signals, cfg: GRPOConfig) -> Estimate:
    return reinforce_pp_advantages(s.scores, s.mask, s.kl, s.kl_coef, cfg.gamma), None


def _reinforce_pp_baseline(s: Signals, cfg: GRPOConfig) -> Estimate:
    return reinforce_pp_baseline_advantages(
        s.scores, cfg.group_size, s.mask, s.kl, s.kl_coef, cfg.gamma
    ), None


def _gae(s: Signals, cfg: GRPOConfig) -> Estimate:
    if s.values is None:
        raise ValueError("grpo.advantage 'gae' needs critic values")
    rewards = kl_penalty_rewards(s.scores, s.mask, s.kl, s.kl_coef)  # (B, C)
    advantages, returns = gae_advantages(rewards, s.values, s.mask, cfg.gamma, cfg.gae_lambda)
    # whitened over the batch's tokens, as PPO implementations do; the critic regresses the raw returns
    return masked_whiten(advantages, s.mask), returns


ESTIMATORS: dict[str, Callable[[Signals, GRPOConfig], Estimate]] = {
    "grpo": _grpo,
    "dr_grpo": _dr_grpo,
    "rloo": _rloo,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
    "gae": _gae,
}
