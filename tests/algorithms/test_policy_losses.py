"""Policy and value losses against hand-computed values: dual clip, clip-higher, GSPO, truncated IS, value clip.

(The plain PPO clip, aggregation and KL estimators are covered in test_grpo_core.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from loopline.algorithms.losses import (
    behaviour_weights,
    clipped_policy_loss,
    clipped_value_loss,
    dual_clip_token_loss,
    gspo_policy_loss,
    ppo_clip_token_loss,
    truncated_is_weights,
)


def _one_token(ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[math.log(0.3)]])
    return (old + math.log(ratio)).requires_grad_(True), old


# ---------------------------------------------------------------- dual clip

# (ratio, advantage, expected loss, gradient zero?) with clip 0.2/0.2 and c = 3:
#   PPO loss L = -min(r A, clip(r, .8, 1.2) A); dual clip: where A < 0, min(L, -c A) = min(L, 3 |A|)
DUAL_CASES = [
    (5.0, -1.0, 3.0, True),  # PPO: -min(-5, -1.2) = 5; capped at 3, constant in r
    (2.0, -1.0, 2.0, False),  # PPO: 2 < 3, unchanged, d/dlogp (-r A) = 2
    (0.5, -1.0, 0.8, True),  # PPO's own clip: -min(-.5, -.8) = .8
    (5.0, 1.0, -1.2, True),  # A > 0 is untouched by the dual clip: -min(5, 1.2)
]


@pytest.mark.parametrize("ratio,adv,expected,flat", DUAL_CASES)
def test_dual_clip_value_and_gradient(ratio, adv, expected, flat):
    logp, old = _one_token(ratio)
    out = clipped_policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 1), dual_clip=3.0)
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0 if flat else -ratio * adv]]))


def test_dual_clip_is_ppo_below_the_cap_and_rejects_c_at_most_one():
    ratio = torch.tensor([[0.7, 1.0, 1.3, 2.5]])
    adv = torch.tensor([[1.0, -2.0, -0.5, 0.3]])
    # no token reaches -3 A on the negative side: identical to PPO
    torch.testing.assert_close(
        dual_clip_token_loss(ratio, adv, 0.2, 0.2, 3.0), ppo_clip_token_loss(ratio, adv, 0.2, 0.2)
    )
    with pytest.raises(ValueError, match="clip_c > 1"):
        dual_clip_token_loss(ratio, adv, 0.2, 0.2, 1.0)


# ---------------------------------------------------------------- asymmetric clip (DAPO clip-higher)


def test_clip_higher_only_moves_the_upper_bound():
    # clip_low .2, clip_high .28, tokens (r, A):
    #   (1.25, +1): inside [.8, 1.28]            -> -1.25 (with symmetric .2 it would clip to -1.2)
    #   (1.40, +1): above                         -> -1.28, clipped
    #   (0.70, -1): below, A < 0                  -> -min(-.7, -.8) = .8, clipped (lower bound still .8)
    #   (0.85, -1): inside                        -> .85
    # token_mean: (-1.25 - 1.28 + .8 + .85)/4 = -.22; clip fraction 2/4
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.25, 1.4, 0.7, 0.85]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = clipped_policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(out.loss, torch.tensor(-0.22))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(0.5))


# ---------------------------------------------------------------- truncated importance sampling


def test_truncated_is_weights():
    # trainer (old) vs engine (behaviour) probabilities: .5 vs .25 -> 2, capped at 1.5; .4 vs .8 -> .5;
    # the masked position is 1 whatever the log-probs say
    old = torch.log(torch.tensor([[0.5, 0.4, 0.9]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[0.25, 0.8, 1e-6]]))
    w = truncated_is_weights(old, behaviour, torch.tensor([[1.0, 1.0, 0.0]]), cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 1.0]]))
    assert not w.requires_grad  # a weight, not a path for gradients


def test_is_weights_scale_the_per_token_loss():
    # ratio 1 everywhere, A = 1: per-token loss -1, times weights [1.5, .5] -> token mean -(1.5 + .5)/2 = -1
    logp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[1.5, 0.5]])
    out = clipped_policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), is_weights=w)
    torch.testing.assert_close(out.loss, torch.tensor(-1.0))
    out.loss.backward()
    # d/dlogp_t of -(w_t r_t A) / 2 = -w_t / 2
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.75, -0.25]]))


# ---------------------------------------------------------------- GSPO

# row 0: mask [1, 1, 0], log-ratios [.1, .3, (9)] -> mean .2, s = e^.2 = 1.2214 > 1.2; A = +1 -> loss -1.2, clipped
# row 1: mask [1, 1, 1], log-ratios [-.1, 0, .1]  -> mean 0, s = 1;            A = -2 -> loss 2
GSPO_LOG_RATIO = torch.tensor([[0.1, 0.3, 9.0], [-0.1, 0.0, 0.1]])
GSPO_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
GSPO_ADV = torch.tensor([1.0, -2.0])


def test_gspo_sequence_ratio_and_clip():
    old = torch.full((2, 3), -1.0)
    logp = (old + GSPO_LOG_RATIO).requires_grad_(True)
    out = gspo_policy_loss(logp, old, GSPO_ADV, GSPO_MASK, clip_low=0.2, clip_high=0.2, agg="seq_mean")
    # seq_mean: (-1.2 + 2)/2 = .4; clipped tokens: row 0's 2 of 5 masked tokens
    torch.testing.assert_close(out.loss, torch.tensor(0.4))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(0.4))
    out.loss.backward()
    # row 0 is clipped: no gradient. row 1: d/dlogp_t [-(s A)/2] = -A s (1/3) / 2 = 2/6 on each token
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]))


def test_gspo_token_mean_and_empty_row():
    old = torch.zeros(3, 3)
    logp = torch.cat([old[:2] + GSPO_LOG_RATIO, torch.full((1, 3), 5.0)])
    mask = torch.cat([GSPO_MASK, torch.zeros(1, 3)])  # row 2: all padding
    adv = torch.tensor([1.0, -2.0, 7.0])
    # token_mean: row 0 spreads -1.2 over 2 tokens, row 1 spreads 2 over 3: (-2.4 + 6)/5 = .72
    out = gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, agg="token_mean")
    torch.testing.assert_close(out.loss, torch.tensor(0.72))
    # seq_mean counts the empty row as 0: (-1.2 + 2 + 0)/3
    out = gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, agg="seq_mean")
    torch.testing.assert_close(out.loss, torch.tensor(0.8 / 3))


# ---------------------------------------------------------------- value loss

# t0: V 1.0, V_old .9, R 1.5: unclipped (1 - 1.5)^2 = .25; V_clip = .9 + clip(.1) = 1.0, same -> .5 * .25 = .125
# t1: V 2.0, V_old 1.0, R 3.0: unclipped 1; V_clip = 1 + clip(1, -.2, .2) = 1.2, (1.2 - 3)^2 = 3.24 -> 1.62, clipped
# t2: masked
VALUES = torch.tensor([[1.0, 2.0, 100.0]])
OLD_VALUES = torch.tensor([[0.9, 1.0, 0.0]])
RETURNS = torch.tensor([[1.5, 3.0, 0.0]])
VMASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_clipped_value_loss():
    values = VALUES.clone().requires_grad_(True)
    out = clipped_value_loss(values, OLD_VALUES, RETURNS, VMASK, clip_range=0.2)
    torch.testing.assert_close(out.loss, torch.tensor((0.125 + 1.62) / 2))
    torch.testing.assert_close(out.clip_fraction, torch.tensor(0.5))
    out.loss.backward()
    # t0: d/dV .5 (V - R)^2 / 2 = (1 - 1.5)/2 = -.25; t1: the clipped branch is flat in V; t2 masked
    torch.testing.assert_close(values.grad, torch.tensor([[-0.25, 0.0, 0.0]]))


def test_unclipped_value_loss_and_empty_mask():
    # no clip: .5 * [.25, 1] token mean = .3125
    out = clipped_value_loss(VALUES, OLD_VALUES, RETURNS, VMASK, clip_range=None)
    torch.testing.assert_close(out.loss, torch.tensor(0.3125))
    assert float(out.clip_fraction) == 0.0
    out = clipped_value_loss(VALUES, OLD_VALUES, RETURNS, torch.zeros(1, 3))
    assert float(out.loss) == 0.0 and float(out.clip_fraction) == 0.0


# ---------------------------------------------------------------- truncated rows and batch of one


def test_policy_loss_all_masked_is_zero_with_zero_gradient():
    logp = torch.randn(2, 3, requires_grad=True)
    out = clipped_policy_loss(
        logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3), dual_clip=3.0
    )
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert float(out.clip_fraction) == 0.0 and float(out.approx_kl) == 0.0


# ---------------------------------------------------------------- behaviour correction (off-policy samples)

# trainer (proximal) vs engine (behaviour) probabilities: rho = .5/.25 = 2, .4/.8 = .5, .9/.3 = 3; the
# fourth token is off the mask, so whatever its log-probs say its weight is 1
PROXIMAL = torch.log(torch.tensor([[0.5, 0.4, 0.9, 0.2]]))
BEHAVIOUR = torch.log(torch.tensor([[0.25, 0.8, 0.3, 0.01]]))
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "cap", "weights", "cut"),
    [
        ("tis", 2.5, [2.0, 0.5, 2.5, 1.0], 1 / 3),  # 3 truncated to 2.5
        ("mask_token", 2.5, [2.0, 0.5, 0.0, 1.0], 1 / 3),  # 3 > 2.5 zeroed; .5 >= 1/2.5 kept
        ("mask_token", 1.9, [0.0, 0.0, 0.0, 1.0], 1.0),  # 2 > 1.9, .5 < 1/1.9, 3 > 1.9
        ("mask_seq", 2.5, [2.0, 0.5, 3.0, 1.0], 0.0),  # geometric mean (2 * .5 * 3)^(1/3) = 1.44: kept whole
        ("mask_seq", 1.4, [0.0, 0.0, 0.0, 1.0], 1.0),  # 1.44 > 1.4: the whole sequence zeroed
    ],
)
def test_behaviour_weights_by_hand(mode, cap, weights, cut):
    out = behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, mode, cap)
    torch.testing.assert_close(out.weights, torch.tensor([weights]))
    assert out.cut_fraction == pytest.approx(cut)
    assert (out.low, out.high, out.mean) == pytest.approx((0.5, 3.0, 5.5 / 3))  # raw rho on the mask


def test_mask_seq_judges_each_sequence_by_its_own_tokens():
    # row 0: rho 2 and .5 (geometric mean 1, kept); row 1: rho 3 and 3 (mean 3, zeroed); padding is ignored
    proximal = torch.log(torch.tensor([[0.5, 0.4, 0.7], [0.9, 0.6, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.8, 0.01], [0.3, 0.2, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = behaviour_weights(proximal, behaviour, mask, "mask_seq", 2.0)
    # row 1's third token has rho 1, but its sequence mean (3 * 3 * 1)^(1/3) = 2.08 > 2 zeroes it too
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 0.5, 1.0], [0.0, 0.0, 0.0]]))
    assert out.cut_fraction == pytest.approx(3 / 5)


def test_zeroed_tokens_still_count_in_the_loss_normalisation():
    # A = 1, ratio 1: per-token loss -1; weights [2, 0, 1] over 3 drawn tokens -> -(2 + 0 + 1) / 3 = -1,
    # not -(2 + 1) / 2 as it would be if the masked token left the denominator
    logp = torch.zeros(1, 3, requires_grad=True)
    w = torch.tensor([[2.0, 0.0, 1.0]])
    out = clipped_policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 3), is_weights=w)
    torch.testing.assert_close(out.loss, torch.tensor(-1.0))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, 0.0, -1 / 3]]))


def test_behaviour_weights_are_detached_and_refuse_a_cap_of_one():
    proximal = PROXIMAL.clone().requires_grad_(True)
    assert not behaviour_weights(proximal, BEHAVIOUR, MASK, "tis", 2.0).weights.requires_grad
    with pytest.raises(ValueError, match="cap > 1"):
        behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "tis", 1.0)
    with pytest.raises(ValueError, match="unknown behaviour correction"):
        behaviour_weights(PROXIMAL, BEHAVIOUR, MASK, "clip", 2.0)  # type: ignore[arg-type]
