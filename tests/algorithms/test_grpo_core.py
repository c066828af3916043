"""GRPO maths against hand-computed values: group advantages, the clipped surrogate, aggregation, KL.

Every expected number is worked out in a comment next to the assertion.
"""

from __future__ import annotations

import math

import pytest
import torch

from loopline.algorithms.advantages import group_advantages
from loopline.algorithms.losses import aggregate, clipped_policy_loss, kl_estimate

# ---------------------------------------------------------------------------------------------
# group_advantages
# ---------------------------------------------------------------------------------------------

# Two groups of 4: [1, 0, 0, 1] (mixed) and [1, 1, 1, 1] (all equal).
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
EPS = 1e-4


def test_group_scale_divides_by_bessel_group_std():
    # group 1: mean 0.5, centred [.5, -.5, -.5, .5], sum of squares 1, Bessel var 1/3, std 0.57735
    # group 2: centred all 0, std 0 -> 0 / (0 + eps) = 0 exactly
    std1 = math.sqrt(1 / 3)
    a = 0.5 / (std1 + EPS)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    got = group_advantages(REWARDS, 4, "group", EPS)
    torch.testing.assert_close(got, expected)
    assert torch.isfinite(got).all()


def test_batch_scale_centres_per_group_divides_by_batch_std():
    # batch mean 0.75; deviations [.25,-.75,-.75,.25,.25,.25,.25,.25];
    # squares: 6 * .0625 + 2 * .5625 = 1.5; Bessel var 1.5 / 7; std 0.46291
    std = math.sqrt(1.5 / 7)
    a = 0.5 / (std + EPS)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, 4, "batch", EPS), expected)


def test_none_scale_only_centres():
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(REWARDS, 4, "none", EPS), expected)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_rewards_give_zero_advantages_without_nan(scale):
    # every group constant (and the whole batch constant, so the batch std is 0 as well)
    rewards = torch.tensor([0.0, 0.0, 0.0, 3.0, 3.0, 3.0])
    got = group_advantages(rewards, 3, scale, eps=0.0 if scale == "none" else EPS)
    assert torch.equal(got, torch.zeros(6))


def test_rewards_must_fill_whole_groups():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 4, "bogus")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# clipped_policy_loss
# ---------------------------------------------------------------------------------------------

# (ratio, advantage, expected per-token loss, clipped?) with clip 0.2 / 0.2:
#   loss = -min(r A, clip(r, 0.8, 1.2) A)
CLIP_CASES = [
    (1.1, 1.0, -1.1, False),  # inside: -min(1.1, 1.1)
    (1.5, 1.0, -1.2, True),  # above, A>0: -min(1.5, 1.2) = -1.2, no gradient
    (0.5, 1.0, -0.5, False),  # below, A>0: -min(0.5, 0.8) = -0.5, pessimistic side is unclipped
    (0.9, -1.0, 0.9, False),  # inside: -min(-0.9, -0.9)
    (0.5, -1.0, 0.8, True),  # below, A<0: -min(-0.5, -0.8) = 0.8, no gradient
    (1.5, -1.0, 1.5, False),  # above, A<0: -min(-1.5, -1.2) = 1.5, unclipped
]


@pytest.mark.parametrize("ratio,adv,expected,clipped", CLIP_CASES)
def test_clipped_loss_value_and_gradient(ratio, adv, expected, clipped):
    old = torch.tensor([[math.log(0.3)]])
    logp = (old + math.log(ratio)).requires_grad_(True)
    out = clipped_policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1), 0.2, 0.2, "token_mean")
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    out.loss.backward()
    # d/dlogp of -r A is -r A (r = exp(logp - old)); the clipped branch is constant in logp
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0 if clipped else -ratio * adv]]))
    assert float(out.clip_fraction) == (1.0 if clipped else 0.0)


def test_asymmetric_clip_high():
    # clip_high 0.28: r = 1.25 with A = 1 is inside [0.8, 1.28], loss -1.25; r = 1.4 clips to -1.28
    old = torch.zeros(2, 1)
    logp = torch.log(torch.tensor([[1.25], [1.4]]))
    adv = torch.tensor([1.0, 1.0])
    out = clipped_policy_loss(logp, old, adv, torch.ones(2, 1), 0.2, 0.28, "seq_mean")
    torch.testing.assert_close(out.loss, torch.tensor(-(1.25 + 1.28) / 2))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(0.5))


def test_per_token_advantages_and_mask():
    # (B, T) advantages; the masked token (ratio 3, way outside) must not count
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 1.1, 3.0]]))
    adv = torch.tensor([[2.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = clipped_policy_loss(logp, old, adv, mask, 0.2, 0.2, "token_mean")
    # token 0: -min(2, 2) = -2; token 1: -min(-1.1, -1.1) = 1.1; mean over 2 tokens = -0.45
    torch.testing.assert_close(out.loss, torch.tensor(-0.45))
    assert float(out.clip_fraction) == 0.0


def test_approx_kl_is_k3_of_old_to_new():
    # one token: old p = 0.5, new p = 0.25 -> r = new/old = 0.5, log r = -0.693147
    # k3 = (r - 1) - log r = -0.5 + 0.693147 = 0.193147
    old = torch.log(torch.tensor([[0.5]]))
    new = torch.log(torch.tensor([[0.25]]))
    out = clipped_policy_loss(new, old, torch.tensor([1.0]), torch.ones(1, 1))
    torch.testing.assert_close(out.approx_kl, torch.tensor(0.5 - 1 + math.log(2)))


# ---------------------------------------------------------------------------------------------
# aggregate
# ---------------------------------------------------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


def test_aggregate_modes():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # token_mean: (1 + 2 + 4) / 3 tokens
    torch.testing.assert_close(aggregate(VALUES, mask, "token_mean"), torch.tensor(7 / 3))
    # seq_mean: row means 1.5 and 4.0, averaged: 2.75
    torch.testing.assert_close(aggregate(VALUES, mask, "seq_mean"), torch.tensor(2.75))
    # fixed_length: 7 / (B=2 * max_len=4)
    torch.testing.assert_close(aggregate(VALUES, mask, "fixed_length", 4), torch.tensor(7 / 8))


def test_aggregate_fully_masked_row():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # token_mean: (1 + 2) / 2; seq_mean: (1.5 + 0) / 2 (an empty row counts as 0); fixed: 3 / (2 * 3)
    torch.testing.assert_close(aggregate(VALUES, mask, "token_mean"), torch.tensor(1.5))
    torch.testing.assert_close(aggregate(VALUES, mask, "seq_mean"), torch.tensor(0.75))
    torch.testing.assert_close(aggregate(VALUES, mask, "fixed_length", 3), torch.tensor(0.5))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "fixed_length"])
def test_aggregate_all_masked_is_zero_with_finite_gradient(mode):
    values = VALUES.clone().requires_grad_(True)
    out = aggregate(values, torch.zeros(2, 3), mode, 3)
    assert float(out.detach()) == 0.0
    out.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))


def test_aggregate_rejects_bad_mode_and_missing_max_len():
    with pytest.raises(ValueError, match="max_len"):
        aggregate(VALUES, torch.ones(2, 3), "fixed_length")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(VALUES, torch.ones(2, 3), "sum")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------


def test_kl_estimators_hand_values():
    # policy p = 0.5, reference q = 0.25: log(q / p) = -log 2
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    ln2 = math.log(2)
    # k1 = -log(q/p) = log 2
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([ln2]))
    # k2 = 0.5 * log(q/p)^2 = 0.5 * ln2^2 = 0.240227
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * ln2**2]))
    # k3 = q/p - 1 - log(q/p) = 0.5 - 1 + ln2 = 0.193147
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 - 1 + ln2]))


def test_k1_and_k3_are_unbiased_for_kl():
    # Over a whole categorical distribution, E_p[k] = sum_x p(x) k(x) must equal
    # KL(p || q) = sum_x p(x) log(p(x) / q(x)) for k1 and k3 (k2 is biased, so it must differ).
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    expect = {k: float((p * kl_estimate(p.log(), q.log(), k)).sum()) for k in ("k1", "k2", "k3")}
    assert expect["k1"] == pytest.approx(exact, rel=1e-12)
    assert expect["k3"] == pytest.approx(exact, rel=1e-12)
    assert expect["k2"] != pytest.approx(exact, rel=1e-3)
    # and k3 is non-negative per token, k1 is not
    assert (kl_estimate(p.log(), q.log(), "k3") >= 0).all()
    assert (kl_estimate(p.log(), q.log(), "k1") < 0).any()


def test_kl_bad_kind():
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]
