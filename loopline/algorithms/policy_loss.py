"""The RL policy objective as one object: built once from the run's settings, applied to each micro-batch.

`PolicyLoss` holds what does not change during a phase (the surrogate and its clip range, the aggregation,
the entropy bonus, the KL estimator); a call takes what does: the micro-batch's tensors and the current KL
coefficient (an adaptive controller moves it every step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from loopline.algorithms.losses import (
    Aggregation,
    PolicyLossOutput,
    aggregate,
    clipped_policy_loss,
    gspo_policy_loss,
    kl_estimate,
)


@dataclass
class PolicyObjective:
    """One micro-batch's objective and its parts, for the backward pass and the step's statistics."""

    loss: torch.Tensor  # () surrogate - entropy_coef * entropy bonus + kl_coef * KL: what is back-propagated
    surrogate: PolicyLossOutput  # the policy surrogate alone, with its clip fraction and approx KL
    kl: torch.Tensor  # () the aggregated KL to the reference (0 when the term is off)


@dataclass(frozen=True)
class PolicyLoss:
    """The policy surrogate + entropy bonus + KL-to-reference term of GRPO-family RL.

    surrogate = "clip": PPO/GRPO token-ratio clip (clip-higher when clip_high > clip_low; dual clip when
    dual_clip is set); "gspo": the clip on the length-normalised sequence ratio. Every term is aggregated
    with `agg` (max_len: the response width fixed_length divides by), so micro-batches accumulate exactly.
    """

    surrogate: Literal["clip", "gspo"] = "clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: Aggregation = "token_mean"
    max_len: int | None = None
    entropy_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"

    def policy_loss(
        self,
        logp: torch.Tensor,
        old: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        is_weights: torch.Tensor | None = None,
    ) -> PolicyLossOutput:
        """The surrogate alone. logp, old, mask: (B, T); advantages: (B,) or (B, T) (clip only); is_weights:
        (B, T) behaviour weights (losses.behaviour_weights) multiplied into the per-token loss."""
        if self.surrogate == "gspo":
            return gspo_policy_loss(
                logp, old, advantages, mask, self.clip_low, self.clip_high, self.agg, self.max_len,
                is_weights=is_weights,
            )  # fmt: skip
        return clipped_policy_loss(
            logp, old, advantages, mask, self.clip_low, self.clip_high, self.agg, self.max_len,
            dual_clip=self.dual_clip, is_weights=is_weights,
        )  # fmt: skip

    def __call__(
        self,
        logp: torch.Tensor,
        old: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        entropy: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        kl_coef: float,
        is_weights: torch.Tensor | None = None,
    ) -> PolicyObjective:
        """surrogate - entropy_coef * agg(entropy) + kl_coef * agg(KL(pi || ref)); the KL term only when
        kl_coef is not 0 and the reference's log-probs are given. entropy, ref_logprobs, is_weights: (B, T)."""
        surrogate = self.policy_loss(logp, old, advantages, mask, is_weights)
        loss = surrogate.loss
        if self.entropy_coef:
            loss = loss - self.entropy_coef * aggregate(entropy, mask, self.agg, self.max_len)
        kl = torch.zeros(())
        if kl_coef and ref_logprobs is not None:
            kl = aggregate(kl_estimate(logp, ref_logprobs, self.kl_estimator), mask, self.agg, self.max_len)
            loss = loss + kl_coef * kl
        return PolicyObjective(loss=loss, surrogate=surrogate, kl=kl)
