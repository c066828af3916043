"""Advantage estimators against hand-computed values: Dr. GRPO, RLOO, REINFORCE++(-baseline), GAE.

(GRPO's group_advantages is covered in test_grpo_core.py.) Every expected number is worked out in a
comment next to the assertion.
"""

from __future__ import annotations

import math

import pytest
import torch

from loopline.algorithms.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

# ---------------------------------------------------------------- Dr. GRPO


def test_dr_grpo_only_centres():
    # group [1, 0, 0, 1]: mean 0.5 -> [.5, -.5, -.5, .5]; group [2, 2, 2, 2] (all equal) -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(dr_grpo_advantages(rewards, 4), expected)


# ---------------------------------------------------------------- RLOO


def test_rloo_leave_one_out_baseline():
    # group [0, 3, 6]: A_0 = 0 - (3 + 6)/2 = -4.5, A_1 = 3 - (0 + 6)/2 = 0, A_2 = 6 - (0 + 3)/2 = 4.5
    # group [3, 1]:    A = [3 - 1, 1 - 3] = [2, -2]  (sizes differ only across calls; here n = 3)
    got = rloo_advantages(torch.tensor([0.0, 3.0, 6.0]), 3)
    torch.testing.assert_close(got, torch.tensor([-4.5, 0.0, 4.5]))
    torch.testing.assert_close(rloo_advantages(torch.tensor([3.0, 1.0]), 2), torch.tensor([2.0, -2.0]))


def test_rloo_equals_scaled_group_centring():
    # A_i = r_i - (S - r_i)/(n-1) = n/(n-1) * (r_i - S/n); group [1, 0, 0, 1]: 4/3 * 0.5 = 2/3
    got = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0]), 4)
    a = 2.0 / 3.0
    torch.testing.assert_close(got, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))


def test_rloo_needs_two_samples_and_whole_groups():
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(torch.tensor([1.0]), 1)
    with pytest.raises(ValueError, match="group_size=2"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)


# ---------------------------------------------------------------- returns and whitening


def test_discounted_returns():
    # rewards [0, 0, 1, (pad)], gamma 0.5: G_2 = 1, G_1 = 0.5, G_0 = 0.25; the pad reports 0
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), torch.tensor([[0.25, 0.5, 1.0, 0.0]]))


def test_discounted_returns_skip_holes_in_the_mask():
    # mask [1, 0, 1, 1] (position 1 is tool output): its reward 5 is dropped and no discount is spent on it.
    # G_3 = 1, G_2 = 0 + .5 * 1 = .5, G_0 = 0 + .5 * G_2 = .25
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), torch.tensor([[0.25, 0.0, 0.5, 1.0]]))


def test_masked_whiten():
    # masked values [1, 2, 3]: mean 2, population var (1 + 0 + 1)/3 = 2/3, std 0.8165 -> [-1.2247, 0, 1.2247]
    values = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    s = math.sqrt(1.5)
    torch.testing.assert_close(masked_whiten(values, mask), torch.tensor([[-s, 0.0, s, 0.0]]))


def test_masked_whiten_degenerate_masks_give_zeros():
    values = torch.tensor([[3.0, 4.0]])
    assert torch.equal(masked_whiten(values, torch.zeros(1, 2)), torch.zeros(1, 2))  # empty mask
    assert torch.equal(
        masked_whiten(values, torch.tensor([[0.0, 1.0]])), torch.zeros(1, 2)
    )  # one token: std 0


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_outcome_only():
    # scores [1, 0]; mask rows [1, 1, 0] and [1, 0, 0]; gamma 1, no KL.
    # rewards: row 0 gets 1 on its last token (t=1); returns row 0 = [1, 1], row 1 = [0]
    # masked returns [1, 1, 0]: mean 2/3, population var (1/9 + 1/9 + 4/9)/3 = 2/9, std sqrt(2)/3
    # A = (1 - 2/3) / (sqrt(2)/3) = 1/sqrt(2) for row 0; (0 - 2/3) / (sqrt(2)/3) = -sqrt(2) for row 1
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    h = 1 / math.sqrt(2)
    expected = torch.tensor([[h, h, 0.0], [-math.sqrt(2), 0.0, 0.0]])
    torch.testing.assert_close(reinforce_pp_advantages(scores, mask), expected)


def test_reinforce_pp_kl_in_reward():
    # one sequence of 3 tokens, score 1, kl [.5, .2, .1], kl_coef .1, gamma 1:
    # rewards [-.05, -.02, -.01 + 1] = [-.05, -.02, .99]; returns [.92, .97, .99]
    # mean .96, deviations [-.04, .01, .03], population var (.0016 + .0001 + .0009)/3 = .0026/3,
    # A = deviation / (std + 1e-8) (the eps matters at this scale in float64)
    scores = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    kl = torch.tensor([[0.5, 0.2, 0.1]], dtype=torch.float64)
    std = math.sqrt(0.0026 / 3)
    expected = torch.tensor([[-0.04, 0.01, 0.03]], dtype=torch.float64) / (std + 1e-8)
    got = reinforce_pp_advantages(scores, mask, kl, kl_coef=0.1, gamma=1.0)
    torch.testing.assert_close(got, expected)


def test_reinforce_pp_discount_and_padding_rows():
    # score 1 on a 2-token row, gamma .5 -> returns [.5, 1]; an all-padding row adds nothing to the stats.
    # masked returns [.5, 1]: mean .75, std .25 -> A = [-1, 1]
    scores = torch.tensor([1.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    got = reinforce_pp_advantages(scores, mask, gamma=0.5)
    torch.testing.assert_close(got, torch.tensor([[-1.0, 1.0], [0.0, 0.0]], dtype=torch.float64))


def test_reinforce_pp_baseline():
    # scores [1, 0 | 0, 0] in groups of 2 -> centred [.5, -.5, 0, 0]; one token each -> returns the same.
    # mean 0, population var (.25 + .25)/4 = .125, std .35355 -> [1.4142, -1.4142, 0, 0]
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = torch.ones(4, 1)
    got = reinforce_pp_baseline_advantages(scores, 2, mask)
    r2 = math.sqrt(2)
    torch.testing.assert_close(got, torch.tensor([[r2], [-r2], [0.0], [0.0]]))


def test_reinforce_pp_baseline_all_equal_groups_are_zero():
    # every group constant: centred scores 0, returns 0, whitening of zeros stays 0 (no NaN)
    scores = torch.tensor([3.0, 3.0, 1.0, 1.0])
    got = reinforce_pp_baseline_advantages(scores, 2, torch.ones(4, 3))
    assert torch.equal(got, torch.zeros(4, 3))


def test_reinforce_pp_batch_of_one_token():
    # a single token: its return equals the batch mean -> 0, not NaN
    got = reinforce_pp_advantages(torch.tensor([2.0]), torch.ones(1, 1))
    assert torch.equal(got, torch.zeros(1, 1))


# ---------------------------------------------------------------- GAE


def test_gae_hand_values():
    # rewards [0, 0, 1], values [.5, .6, .7], gamma .9, lambda .8 (gamma * lambda = .72), V after the end = 0
    # t=2: delta = 1 + .9*0 - .7 = .3                A_2 = .3
    # t=1: delta = 0 + .9*.7 - .6 = .03               A_1 = .03 + .72*.3 = .246
    # t=0: delta = 0 + .9*.6 - .5 = .04               A_0 = .04 + .72*.246 = .21712
    # returns = A + V = [.71712, .846, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]], dtype=torch.float64))


def test_gae_lambda_limits():
    # lambda = 1: A_t = G_t - V_t (Monte Carlo); lambda = 0: A_t = delta_t (one-step TD)
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(3, 5, generator=g, dtype=torch.float64)
    values = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    adv1, ret1 = gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    torch.testing.assert_close(ret1, discounted_returns(rewards, mask, 0.9))
    torch.testing.assert_close(adv1, discounted_returns(rewards, mask, 0.9) - values)
    adv0, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.0)
    next_v = torch.cat([values[:, 1:], torch.zeros(3, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(adv0, rewards + 0.9 * next_v - values)


def test_gae_masks_holes_padding_and_empty_rows():
    # row 0, mask [1, 0, 1]: the off-mask value 100 and reward 9 are skipped.
    #   t=2: A = 1 - .7 = .3; t=0: delta = 0 + .9*.7 - .5 = .13, A = .13 + .72*.3 = .346
    # row 1: all padding -> zeros
    rewards = torch.tensor([[0.0, 9.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 100.0, 0.7], [3.0, 3.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.346, 0.0, 0.3], [0.0, 0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.846, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
