"""Edges of the pure functions that the other algorithm tests leave open, found by mutation testing
(`make mutation`): documented defaults, statistics (clip fractions, approx KL, implicit rewards),
boundaries of the validity checks, dtype handling and clamps. Expected values are worked out in comments.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from loopline.algorithms.advantages import (
    discounted_returns,
    gae_advantages,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from loopline.algorithms.dapo import informative_groups, mask_truncated, overlong_penalty
from loopline.algorithms.kl import AdaptiveKLController, kl_penalty_rewards
from loopline.algorithms.losses import (
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    gspo_policy_loss,
    kl_estimate,
    ppo_clip_token_loss,
    truncated_is_weights,
)
from loopline.algorithms.preference import (
    dpo_hinge_loss,
    dpo_ipo_loss,
    dpo_robust_loss,
    dpo_sigmoid_loss,
)
from loopline.algorithms.reward import whiten_clip

T = torch.tensor


def _raises(message: str):
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


# ---------------------------------------------------------------- advantages


def test_group_advantages_defaults_and_edge_groups():
    # default scale "group", eps 1e-4: [1, 3] -> centred [-1, 1], Bessel std sqrt(2)
    s2 = math.sqrt(2.0)
    torch.testing.assert_close(group_advantages(T([1.0, 3.0]), 2), T([-1 / (s2 + 1e-4), 1 / (s2 + 1e-4)]))
    # batch std over the two rewards (also sqrt 2)
    torch.testing.assert_close(group_advantages(T([1.0, 3.0]), 2, "batch", eps=0.0), T([-1 / s2, 1 / s2]))
    # groups of one: nothing to compare against, every advantage 0 (no NaN from a 1-sample std)
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(group_advantages(T([2.0, 5.0]), 1, scale), T([0.0, 0.0]))
        torch.testing.assert_close(group_advantages(T([2.0]), 1, scale), T([0.0]))


def test_grouping_checks_shape_and_size_exactly():
    message = "rewards must be 1-D with a multiple of group_size=2 entries"
    with _raises(message):
        group_advantages(torch.zeros(2, 2), 2)  # 2-D, although 4 is a multiple of 2
    with _raises(message):
        informative_groups(torch.zeros(2, 2), 2)
    with _raises("rewards must be 1-D with a multiple of group_size=0 entries"):
        group_advantages(torch.zeros(2), 0)
    with _raises("RLOO needs group_size >= 2: the baseline is the mean of the other samples"):
        rloo_advantages(T([1.0]), 1)


def test_token_level_defaults_and_eps():
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    kl = T([[1.0, 1.0], [1.0, 1.0]])
    # defaults: no KL (kl_coef 0) and gamma 1: returns [[1, 1], [0, -]], mean 2/3, population std sqrt(2)/3
    std = math.sqrt(2.0) / 3
    a, b = (1 - 2 / 3) / std, (0 - 2 / 3) / std
    torch.testing.assert_close(reinforce_pp_advantages(T([1.0, 0.0]), mask, kl), T([[a, a], [b, 0.0]]))
    # default gamma 1 with a baseline: centred scores [0.5, -0.5] -> returns [[.5, .5], [-.5]]: same whitening
    torch.testing.assert_close(
        reinforce_pp_baseline_advantages(T([1.0, 0.0]), 2, mask, kl), T([[a, a], [b, 0.0]])
    )
    # eps is passed on: eps = 1 -> (x - mean) / (std + 1)
    e = std + 1.0
    want = T([[(1 / 3) / e, (1 / 3) / e], [(-2 / 3) / e, 0.0]])
    torch.testing.assert_close(reinforce_pp_advantages(T([1.0, 0.0]), mask, eps=1.0), want)
    torch.testing.assert_close(reinforce_pp_baseline_advantages(T([1.0, 0.0]), 2, mask, eps=1.0), want)


def test_reinforce_pp_baseline_passes_kl_and_gamma_on():
    # one row of 2 tokens in a group of 2 with an empty-score partner: scores [2, 0] -> centred [1, -1]
    # KL 0.5 * [1, 3] in the reward, gamma 0.5: row 0 rewards [-0.5, -1.5 + 1] -> returns [-0.5 - 0.25, -0.5]
    # row 1 (one token): reward -0.5 * 2 - 1 = -2 -> return -2. Whitened over [-0.75, -0.5, -2].
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    kl = T([[1.0, 3.0], [2.0, 9.0]])
    got = reinforce_pp_baseline_advantages(T([2.0, 0.0]), 2, mask, kl, 0.5, gamma=0.5)
    vals = T([-0.75, -0.5, -2.0])
    white = (vals - vals.mean()) / (vals.var(unbiased=False).sqrt() + 1e-8)
    torch.testing.assert_close(got, T([[white[0], white[1]], [white[2], 0.0]]))


def test_gae_defaults_gamma_1_lambda_095():
    # one row, two tokens, reward 1 on the last, values [0.5, 0.25]:
    # t1: delta = 1 - 0.25 = 0.75, A1 = 0.75; t0: delta = 0 + 0.25 - 0.5 = -0.25, A0 = -0.25 + 0.95 * 0.75
    adv, ret = gae_advantages(T([[0.0, 1.0]]), T([[0.5, 0.25]]), T([[1.0, 1.0]]))
    torch.testing.assert_close(adv, T([[-0.25 + 0.95 * 0.75, 0.75]]))
    torch.testing.assert_close(ret, T([[-0.25 + 0.95 * 0.75 + 0.5, 1.0]]))


def test_discounted_returns_default_gamma_is_1():
    torch.testing.assert_close(
        discounted_returns(T([[1.0, 2.0, 3.0]]), T([[1.0, 1.0, 1.0]])), T([[6.0, 5.0, 3.0]])
    )


# ---------------------------------------------------------------- KL


def test_kl_penalty_rewards_defaults_dtypes_and_no_kl():
    mask = T([[1.0, 1.0, 0.0]])
    kl = T([[1.0, 2.0, 3.0]])
    # default kl_coef 0: a KL tensor alone changes nothing, the score sits on the last masked token
    torch.testing.assert_close(kl_penalty_rewards(T([5.0]), mask, kl), T([[0.0, 5.0, 0.0]]))
    # a coefficient without a KL tensor (kl_in=loss): no penalty either
    torch.testing.assert_close(kl_penalty_rewards(T([5.0]), mask, None, 0.5), T([[0.0, 5.0, 0.0]]))
    # float64 KL and mask with float32 scores: the rewards take the scores' dtype
    got = kl_penalty_rewards(T([5.0]), mask.double(), kl.double(), 0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, T([[-0.5, -1.0 + 5.0, 0.0]]))


def test_k3_clamps_the_log_ratio_at_20():
    # log_ratio = ref - logp = +-25 is clamped to +-20: k3 = exp(x) - 1 - x
    logp = torch.zeros(2, dtype=torch.float64)
    ref = T([25.0, -25.0], dtype=torch.float64)
    want = T([math.exp(20) - 21, math.exp(-20) - 1 + 20], dtype=torch.float64)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), want)


def test_adaptive_controller_accepts_a_horizon_of_one():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=1)
    assert ctl.update(current_kl=2.0, n_steps=1) == pytest.approx(0.1 * 1.2)  # error clipped to +0.2


# ---------------------------------------------------------------- losses


def test_entropy_from_logits():
    # uniform over 4: ln 4; [0, ln 3] over 2 classes: p = [1/4, 3/4], H = -(1/4 ln 1/4 + 3/4 ln 3/4)
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])  # (1, 2, V=4)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(logits), T([[math.log(4.0), h]]))
    assert entropy_from_logits(logits.double()).dtype == torch.float32  # computed in float32


def test_aggregate_messages_and_fixed_length_needs_max_len():
    with _raises("fixed_length aggregation needs max_len"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "fixed_length")


def test_clip_defaults_and_statistics():
    # default clip 0.2 / 0.2: ratio 1.5 with A = 2 -> -min(3, 2.4) = -2.4; ratio 0.5 with A = 2 -> -1;
    # ratio 0.5 with A = -2 -> -min(-1, -1.6) = 1.6
    got = ppo_clip_token_loss(T([1.5, 0.5, 0.5]), T([2.0, 2.0, -2.0]))
    torch.testing.assert_close(got, T([-2.4, -1.0, 1.6]))
    # statistics: A = 2, ratios [1.5, 1.1, 0.5] on 3 tokens; clipped away where clip(r) A < r A: only 1.5
    # approx_kl = mean(r - 1 - ln r)
    ratio = T([[1.5, 1.1, 0.5]])
    out = clipped_policy_loss(ratio.log(), torch.zeros(1, 3), T([2.0]), torch.ones(1, 3))
    assert float(out.clip_fraction) == pytest.approx(1 / 3)
    want = sum(r - 1 - math.log(r) for r in (1.5, 1.1, 0.5)) / 3
    assert float(out.approx_kl) == pytest.approx(want, rel=1e-5)


def test_gspo_defaults_weights_statistics_and_fixed_length():
    # one sequence of two tokens with log-ratios [x, x]: s = exp(x)
    def run(s: float, adv: float, **kw):
        logp = torch.full((1, 2), math.log(s))
        return gspo_policy_loss(logp, torch.zeros(1, 2), T([adv]), torch.ones(1, 2), **kw)

    # defaults: clip 3e-4 / 4e-4, seq_mean. s = 1.0002 (inside) with A = 2: loss -2 * 1.0002, not clipped
    out = run(1.0002, 2.0)
    assert float(out.loss) == pytest.approx(-2.0004, rel=1e-5) and float(out.clip_fraction) == 0.0
    # s = 1.001 (above 1 + 4e-4) with A = 2: clipped at 1.0004
    out = run(1.001, 2.0)
    assert float(out.loss) == pytest.approx(-2.0008, rel=1e-5) and float(out.clip_fraction) == 1.0
    # s = 0.99 (below 1 - 3e-4) with A = -2: -min(-1.98, -1.9994) = 1.9994, clipped away
    out = run(0.99, -2.0)
    assert float(out.loss) == pytest.approx(1.9994, rel=1e-5) and float(out.clip_fraction) == 1.0
    # per-token weights multiply the spread sequence loss: weights [1, 3] -> mean(-2.0004, -6.0012)
    out = run(1.0002, 2.0, is_weights=T([[1.0, 3.0]]))
    assert float(out.loss) == pytest.approx(-4.0008, rel=1e-5)
    # fixed_length: sum over 2 tokens / (1 * max_len 4)
    out = run(1.0002, 2.0, agg="fixed_length", max_len=4)
    assert float(out.loss) == pytest.approx(-4.0008 / 4, rel=1e-5)


def test_value_loss_pinned_both_sides_of_the_clip():
    # clip 0.2 (default), V_old = 1 everywhere, R = 0:
    #   V = 1.5: unclipped 2.25; V_old + clip(0.5) = 1.2 -> 1.44; max 2.25 -> 1.125 (not clipped away)
    #   V = 0.5: unclipped 0.25; V_old + clip(-0.5) = 0.8 -> 0.64; max 0.64 -> 0.32 (clipped away)
    #   V = 1.1: unclipped 1.21; inside the clip -> 1.21 -> 0.605
    values = T([[1.5, 0.5, 1.1]])
    out = clipped_value_loss(values, torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3))
    assert float(out.loss) == pytest.approx((1.125 + 0.32 + 0.605) / 3, rel=1e-6)
    assert float(out.clip_fraction) == pytest.approx(1 / 3)
    # V_old = 0.3, V = 1.0, R = 0.3: unclipped 0.49; V_old + clip(0.7) = 0.5 -> 0.04; max 0.49 -> 0.245
    out = clipped_value_loss(T([[1.0]]), T([[0.3]]), T([[0.3]]), T([[1.0]]))
    assert float(out.loss) == pytest.approx(0.245) and float(out.clip_fraction) == 0.0
    # a single clipped token: clip fraction 1 / 1
    out = clipped_value_loss(T([[0.5]]), T([[1.0]]), T([[0.0]]), T([[1.0]]))
    assert float(out.clip_fraction) == 1.0
    # fixed_length passes max_len on: (1.125 + 0.32 + 0.605) / (1 * 5)
    out = clipped_value_loss(
        values, torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3), agg="fixed_length", max_len=5
    )
    assert float(out.loss) == pytest.approx((1.125 + 0.32 + 0.605) / 5, rel=1e-6)


def test_truncated_is_weights_default_cap_is_2():
    got = truncated_is_weights(T([[math.log(3.0), 0.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    torch.testing.assert_close(got, T([[2.0, 1.0]]))


# ---------------------------------------------------------------- preference


def test_dpo_defaults_and_implicit_rewards():
    # policy log-ratios chosen +2, rejected -1: delta 3; default beta 0.1 -> beta delta = 0.3
    pc, pr, rc, rr = T([2.0]), T([-1.0]), T([0.0]), T([0.0])
    out = dpo_sigmoid_loss(pc, pr, rc, rr)
    assert float(out.loss) == pytest.approx(math.log1p(math.exp(-0.3)), rel=1e-6)
    torch.testing.assert_close(out.chosen_rewards, T([0.2]))  # beta * (logp - ref)
    torch.testing.assert_close(out.rejected_rewards, T([-0.1]))
    assert float(dpo_hinge_loss(pc, pr, rc, rr).loss) == pytest.approx(0.7)  # relu(1 - 0.3)
    # IPO, default beta: ((2/1 - (-1)/1) - 1/0.2)^2 = (3 - 5)^2 = 4
    assert float(dpo_ipo_loss(pc, pr, rc, rr, T([1]), T([1])).loss) == pytest.approx(4.0)
    # robust, default beta 0.1 and e = 0.1: [-(0.9) logsig(0.3) + 0.1 logsig(-0.3)] / 0.8
    want = (0.9 * math.log1p(math.exp(-0.3)) - 0.1 * math.log1p(math.exp(0.3))) / 0.8
    assert float(dpo_robust_loss(pc, pr, rc, rr).loss) == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------- DAPO and reward transforms


def test_overlong_penalty_boundaries_and_dtypes():
    # max_len 4, cache 1: penalty only for length 4 (excess (4 - 3) / 1 = 1) -> -1
    torch.testing.assert_close(overlong_penalty(T([2, 3, 4]), 4, 1), T([0.0, 0.0, -1.0]))
    # cache == max_len: the whole range, (L - 0) / 4
    torch.testing.assert_close(overlong_penalty(T([0, 2, 4]), 4, 4), T([0.0, -0.5, -1.0]))
    # float64 lengths keep their dtype
    assert overlong_penalty(T([2.0], dtype=torch.float64), 4, 2).dtype == torch.float64


def test_mask_truncated_takes_integer_flags():
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    torch.testing.assert_close(mask_truncated(mask, T([0, 1])), T([[1.0, 1.0], [0.0, 0.0]]))


def test_whiten_clip_edges():
    # default eps 1e-6 and no clip: [0, 2] -> centred [-1, 1], rms 1 -> [-1, 1] / (1 + 1e-6)
    torch.testing.assert_close(whiten_clip(T([0.0, 2.0])), T([-1.0, 1.0]) / (1 + 1e-6))
    # tiny spread: centred +-5e-7, rms 5e-7 -> +-5e-7 / 1.5e-6 = +-1/3 (eps is added, not subtracted)
    torch.testing.assert_close(
        whiten_clip(T([0.0, 1e-6], dtype=torch.float64)), T([-1 / 3, 1 / 3], dtype=torch.float64)
    )
    # clip below 1 is valid and clamps both sides: [0, 0, 0, 4] -> centred [-1, -1, -1, 3], rms sqrt(3)
    got = whiten_clip(T([0.0, 0.0, 0.0, 4.0]), clip=0.5)
    torch.testing.assert_close(got, T([-0.5, -0.5, -0.5, 0.5]))


def test_float64_masks_do_not_change_the_result_dtype():
    # masks may arrive in another float dtype than the values (or as bool); results keep the values' dtype
    v = torch.tensor([[0.5, -1.0, 2.0]])
    m64 = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    assert aggregate(v, m64, "token_mean").dtype == torch.float32
    assert masked_whiten(v, m64).dtype == torch.float32
    out = clipped_policy_loss(v, torch.zeros(1, 3), T([1.0]), m64)
    assert out.loss.dtype == out.clip_fraction.dtype == out.approx_kl.dtype == torch.float32
    assert gspo_policy_loss(v, torch.zeros(1, 3), T([1.0]), m64).loss.dtype == torch.float32
    assert (
        clipped_value_loss(v, torch.zeros(1, 3), torch.ones(1, 3), m64).clip_fraction.dtype == torch.float32
    )
    assert truncated_is_weights(v, torch.zeros(1, 3), m64).dtype == torch.float32


def test_dual_clip_passes_its_own_clip_range_on():
    # clip_low 0.1, clip_high 0.3, c = 3: ratio 1.4 with A = 1 -> -min(1.4, 1.3) = -1.3;
    # ratio 0.5 with A = -1 -> -min(-0.5, -0.9) = 0.9 (below the cap 3)
    from loopline.algorithms.losses import dual_clip_token_loss

    got = dual_clip_token_loss(T([1.4, 0.5]), T([1.0, -1.0]), 0.1, 0.3, 3.0)
    torch.testing.assert_close(got, T([-1.3, 0.9]))
