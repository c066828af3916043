"""KL to the reference policy as a reward penalty, and the controllers that set its coefficient.

The per-token KL estimators themselves (k1/k2/k3) live in losses.kl_estimate, next to the loss that
uses them as a penalty term.
"""

from __future__ import annotations

import torch


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last masked position, (B, T) -> (B,) long; -1 for a row with an empty mask."""
    m = mask.to(torch.bool)
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)  # (B, T)
    return torch.where(m, positions, torch.full_like(positions, -1)).amax(dim=1)


def kl_penalty_rewards(
    scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards r_t = -kl_coef * kl_t on masked tokens, plus the sequence's score on its last one.

    scores: (B,); mask, kl: (B, T). Returns (B, T), 0 off the mask. A row with an empty mask has no
    token to carry its score and gets all zeros.
    """
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)  # (B, T)
    if kl is not None and kl_coef:
        rewards = -kl_coef * kl.to(scores.dtype) * mask.to(scores.dtype)
    last = last_token_index(mask)  # (B,)
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    return rewards.index_put((rows, last[has_tokens]), scores[has_tokens], accumulate=True)


class FixedKLController:
    """A constant KL coefficient, with the same interface as the adaptive one."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> float:
        """Does nothing; returns the coefficient."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (2019): beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon).

    The coefficient grows while the measured KL is above target and shrinks while below, by at most
    20% of n_steps / horizon per update.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}"
            )
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move the coefficient towards the one that keeps KL at target; returns the new value.

        current_kl: the KL measured over the batch just trained on; n_steps: the samples (or steps) it spans.
        """
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])
