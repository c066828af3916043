"""PolicyLoss: the surrogate + entropy bonus + KL term as one object, against the formula written out.

B = 1, T = 2, mask [1, 1], A = +1, on-policy (old = logp, ratio 1): the clip surrogate is -A = -1 per token.
entropy [0.5, 1.5]; log(ref / pi) = [0.1, -0.2] per token.
  token_mean:  surrogate -1;  bonus mean(0.5, 1.5) = 1;  k1 KL = mean(-0.1, 0.2) = 0.05
  loss = -1 - entropy_coef * 1 + kl_coef * 0.05
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loopline.algorithms.losses import clipped_policy_loss, gspo_policy_loss
from loopline.algorithms.policy_loss import PolicyLoss

LOGP = torch.log(torch.tensor([[0.4, 0.6]]))
MASK = torch.ones(1, 2)
ADV = torch.tensor([1.0])
ENTROPY = torch.tensor([[0.5, 1.5]])
REF = LOGP + torch.tensor([[0.1, -0.2]])


@pytest.mark.parametrize(("entropy_coef", "kl_coef"), [(0.0, 0.0), (0.1, 0.0), (0.0, 0.5), (0.1, 0.5)])
def test_loss_is_surrogate_minus_bonus_plus_kl(entropy_coef, kl_coef):
    loss = PolicyLoss(entropy_coef=entropy_coef, kl_estimator="k1")
    out = loss(LOGP, LOGP.detach(), ADV, MASK, ENTROPY, REF, kl_coef)
    torch.testing.assert_close(out.surrogate.loss, torch.tensor(-1.0))
    torch.testing.assert_close(out.kl, torch.tensor(0.05 if kl_coef else 0.0))
    torch.testing.assert_close(out.loss, torch.tensor(-1.0 - entropy_coef * 1.0 + kl_coef * 0.05))


def test_no_kl_term_without_the_reference():
    out = PolicyLoss()(LOGP, LOGP, ADV, MASK, ENTROPY, None, kl_coef=0.5)
    assert float(out.kl) == 0.0 and float(out.loss) == pytest.approx(-1.0)


def test_surrogate_is_the_named_loss_function():
    old = LOGP - torch.tensor([[0.3, -0.1]])
    clip = PolicyLoss(clip_high=0.28, dual_clip=3.0, agg="seq_mean")
    want = clipped_policy_loss(LOGP, old, ADV, MASK, 0.2, 0.28, "seq_mean", None, dual_clip=3.0)
    assert torch.equal(clip.policy_loss(LOGP, old, ADV, MASK).loss, want.loss)
    gspo = PolicyLoss(surrogate="gspo", clip_low=3e-4, clip_high=4e-4, agg="fixed_length", max_len=4)
    want = gspo_policy_loss(LOGP, old, ADV, MASK, 3e-4, 4e-4, "fixed_length", 4)
    assert torch.equal(gspo.policy_loss(LOGP, old, ADV, MASK).loss, want.loss)


def test_is_a_frozen_value():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PolicyLoss().clip_low = 0.3  # type: ignore[misc]
