"""Every advantage estimator and policy-loss variant through the loop's own selection path, pinned.

The GRPO loop picks its parts once from the config: `ESTIMATORS[cfg.advantage](Signals(...), cfg)`
(loops/estimators.py) and `grpo_loss(cfg).policy_loss(logp, old, adv, mask)` (training/policy.py).
These tests call exactly those entries with a `GRPOConfig` on a fixed small batch and compare with values
worked out by hand in the comments (torchtune style), so a wrong mapping (rloo -> the GRPO estimator), a
dropped KL term or a config field that is not passed through fails here, not only in a loop run that
checks that some weight moved.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from loopline.config import GRPOConfig, SamplingConfig
from loopline.loops.estimators import ESTIMATORS, Signals
from loopline.training.policy import grpo_loss


def _cfg(**fields) -> GRPOConfig:
    return GRPOConfig(**fields)


def _whiten(values: list[float]) -> list[float]:
    """(x - mean) / population std, in plain Python: the whitening the token-level estimators apply."""
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    return [(v - mean) / std for v in values]


def _close(got: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- outcome estimators: grpo, dr_grpo, rloo
#
# Two prompts, group_size 3 (B = 6), C = 3 response positions. kl_coef 0.5, KL in the reward.
# Off-mask KL entries are 9 so that a sum that ignores the mask is visible.
#
#   mask               kl (masked sum)          score   sequence reward r = score - 0.5 * sum_t kl_t
#   [1, 1, 0]          [0.5, 0.5, 9]   (1)      2.5     2.5 - 0.5 = 2
#   [1, 1, 1]          [0.0, 1.0, 1.0] (2)      1.0     1.0 - 1.0 = 0
#   [1, 0, 0]          [1.0, 9, 9]     (1)     -1.5    -1.5 - 0.5 = -2
#   [1, 1, 1]          [0.0, 0.0, 0.0] (0)      3.0     3.0 - 0.0 = 3
#   [1, 1, 0]          [1.0, 1.0, 9]   (2)      1.0     1.0 - 1.0 = 0
#   [1, 0, 0]          [3.0, 9, 9]     (3)      1.5     1.5 - 1.5 = 0
#
# group 1: r = [2, 0, -2], mean 0, centred [2, 0, -2], Bessel std sqrt((4 + 0 + 4) / 2) = 2
# group 2: r = [3, 0, 0],  mean 1, centred [2, -1, -1], Bessel std sqrt((4 + 1 + 1) / 2) = sqrt(3)
#
# grpo    (adv_eps 0):  centred / std         = [1, 0, -1, 2/sqrt3, -1/sqrt3, -1/sqrt3]
# dr_grpo:              centred               = [2, 0, -2, 2, -1, -1]
# rloo:   r_i - mean_{j != i} r_j = n/(n-1) * centred = 1.5 * centred = [3, 0, -3, 3, -1.5, -1.5]
#
# Without the KL term (scores as rewards) group 1 would be [2.5, 1, -1.5], mean 2/3: every value moves.

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.float32)
KL = torch.tensor(
    [[0.5, 0.5, 9.0], [0.0, 1.0, 1.0], [1.0, 9.0, 9.0], [0.0, 0.0, 0.0], [1.0, 1.0, 9.0], [3.0, 9.0, 9.0]]
)
SCORES = torch.tensor([2.5, 1.0, -1.5, 3.0, 1.0, 1.5])
S3 = math.sqrt(3.0)

OUTCOME_EXPECTED = {
    "grpo": [1.0, 0.0, -1.0, 2 / S3, -1 / S3, -1 / S3],
    "dr_grpo": [2.0, 0.0, -2.0, 2.0, -1.0, -1.0],
    "rloo": [3.0, 0.0, -3.0, 3.0, -1.5, -1.5],
}


@pytest.mark.parametrize("advantage", sorted(OUTCOME_EXPECTED))
def test_outcome_estimators_with_kl_in_the_reward(advantage):
    cfg = _cfg(advantage=advantage, group_size=3, adv_eps=0.0, kl_coef=0.5, kl_in="reward")
    advantages, returns = ESTIMATORS[cfg.advantage](Signals(SCORES, MASK, KL, cfg.kl_coef), cfg)
    _close(advantages, OUTCOME_EXPECTED[advantage])
    assert advantages.shape == (6,) and returns is None


# Without KL (kl_in=loss: the loop passes kl=None), the scores are the rewards:
# group 1: [2.5, 1, -1.5], mean 2/3, centred [11/6, 1/3, -13/6], Bessel std sqrt((121 + 4 + 169)/36 / 2)
#          = sqrt(294/72) = sqrt(49/12) = 7 / (2 sqrt3)
# group 2: [3, 1, 1.5], mean 11/6, centred [7/6, -5/6, -1/3], Bessel std sqrt((49 + 25 + 4)/36 / 2)
#          = sqrt(78/72) = sqrt(13/12)
G1 = [11 / 6, 1 / 3, -13 / 6]
G2 = [7 / 6, -5 / 6, -1 / 3]
NO_KL_EXPECTED = {
    "grpo": [x / (7 / (2 * S3)) for x in G1] + [x / math.sqrt(13 / 12) for x in G2],
    "dr_grpo": G1 + G2,
    "rloo": [1.5 * x for x in G1 + G2],
}


@pytest.mark.parametrize("advantage", sorted(NO_KL_EXPECTED))
def test_outcome_estimators_without_kl(advantage):
    cfg = _cfg(advantage=advantage, group_size=3, adv_eps=0.0)
    advantages, _ = ESTIMATORS[cfg.advantage](Signals(SCORES, MASK), cfg)
    _close(advantages, NO_KL_EXPECTED[advantage])
    # a coefficient of 0 with a KL tensor is the same as no KL at all
    zero_coef, _ = ESTIMATORS[cfg.advantage](Signals(SCORES, MASK, KL, 0.0), cfg)
    _close(zero_coef, NO_KL_EXPECTED[advantage])


@pytest.mark.parametrize("advantage", sorted(NO_KL_EXPECTED))
def test_kl_in_the_loss_leaves_the_scores_as_rewards(advantage):
    # kl_in=loss: the loop passes no KL tensor but the controller's coefficient (> 0); nothing is subtracted
    cfg = _cfg(advantage=advantage, group_size=3, adv_eps=0.0, kl_coef=0.5)
    advantages, _ = ESTIMATORS[cfg.advantage](Signals(SCORES, MASK, None, cfg.kl_coef), cfg)
    _close(advantages, NO_KL_EXPECTED[advantage])


def test_grpo_scale_and_eps_come_from_the_config():
    # adv_eps=0.5: group 1 centred [2, 0, -2] / (2 + 0.5) = [0.8, 0, -0.8]; group 2 [2, -1, -1] / (sqrt3 + 0.5)
    cfg = _cfg(group_size=3, adv_eps=0.5, kl_coef=0.5, kl_in="reward")
    adv, _ = ESTIMATORS["grpo"](Signals(SCORES, MASK, KL, 0.5), cfg)
    d = S3 + 0.5
    _close(adv, [0.8, 0.0, -0.8, 2 / d, -1 / d, -1 / d])
    # adv_scale=batch: centred / (Bessel std of all six rewards [2, 0, -2, 3, 0, 0]); mean 0.5,
    # squares of deviations 2.25 + .25 + 6.25 + 6.25 + .25 + .25 = 15.5, std = sqrt(15.5 / 5) = sqrt(3.1)
    cfg = _cfg(group_size=3, adv_eps=0.0, adv_scale="batch", kl_coef=0.5, kl_in="reward")
    adv, _ = ESTIMATORS["grpo"](Signals(SCORES, MASK, KL, 0.5), cfg)
    s = math.sqrt(3.1)
    _close(adv, [2 / s, 0.0, -2 / s, 2 / s, -1 / s, -1 / s])
    # adv_scale=none: plain centring
    cfg = _cfg(group_size=3, adv_scale="none", kl_coef=0.5, kl_in="reward")
    adv, _ = ESTIMATORS["grpo"](Signals(SCORES, MASK, KL, 0.5), cfg)
    _close(adv, [2.0, 0.0, -2.0, 2.0, -1.0, -1.0])


def test_group_size_comes_from_the_config():
    # group_size 2 over [2, 0, -2, 3, 0, 0] (KL in the reward as above): groups [2, 0], [-2, 3], [0, 0]
    # dr_grpo: [1, -1, -2.5, 2.5, 0, 0]; rloo (n/(n-1) = 2): [2, -2, -5, 5, 0, 0]
    for advantage, expected in (("dr_grpo", [1, -1, -2.5, 2.5, 0, 0]), ("rloo", [2, -2, -5, 5, 0, 0])):
        cfg = _cfg(advantage=advantage, group_size=2, kl_coef=0.5, kl_in="reward")
        adv, _ = ESTIMATORS[cfg.advantage](Signals(SCORES, MASK, KL, 0.5), cfg)
        _close(adv, [float(x) for x in expected])


# ---------------------------------------------------------------- token-level: reinforce_pp(_baseline)
#
# B = 4 (two groups of 2), C = 2, kl_coef 0.5, gamma 1. Token rewards r_t = -0.5 * kl_t on masked tokens,
# plus the (centred, for the baseline) score on the row's last masked token; returns-to-go, then whitened
# over the 7 masked tokens with the population std.
#
#   mask     kl           score | reinforce_pp: rewards -> returns | baseline: centred score, rewards -> returns
#   [1, 1]   [0.2, 0.4]   1     | [-0.1, 0.8]  -> [0.7, 0.8]       | +0.5: [-0.1, 0.3]  -> [0.2, 0.3]
#   [1, 0]   [0.6, 9]     0     | [-0.3, -]    -> [-0.3, -]        | -0.5: [-0.8, -]    -> [-0.8, -]
#   [1, 1]   [0.2, 0.2]   3     | [-0.1, 2.9]  -> [2.8, 2.9]       |  0:   [-0.1, -0.1] -> [-0.2, -0.1]
#   [0, 1]   [9, 1.0]     3     | [-, 2.5]     -> [-, 2.5]         |  0:   [-, -0.5]    -> [-, -0.5]

TOK_MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1]], dtype=torch.float32)
TOK_KL = torch.tensor([[0.2, 0.4], [0.6, 9.0], [0.2, 0.2], [9.0, 1.0]])
TOK_SCORES = torch.tensor([1.0, 0.0, 3.0, 3.0])


def _place(masked_values: list[float]) -> list[list[float]]:
    """Spread the 7 masked values (row-major) back onto the (4, 2) grid, 0 off the mask."""
    it = iter(masked_values)
    return [[next(it) if m else 0.0 for m in row] for row in TOK_MASK.tolist()]


@pytest.mark.parametrize(
    ("advantage", "returns"),
    [
        ("reinforce_pp", [0.7, 0.8, -0.3, 2.8, 2.9, 2.5]),
        ("reinforce_pp_baseline", [0.2, 0.3, -0.8, -0.2, -0.1, -0.5]),
    ],
)
def test_reinforce_pp_estimators_with_kl_in_the_reward(advantage, returns):
    cfg = _cfg(advantage=advantage, group_size=2, kl_coef=0.5, kl_in="reward")
    adv, critic_targets = ESTIMATORS[cfg.advantage](Signals(TOK_SCORES, TOK_MASK, TOK_KL, 0.5), cfg)
    _close(adv, _place(_whiten(returns)))
    assert critic_targets is None


def test_reinforce_pp_discount_comes_from_the_config():
    # gamma 0.5, no KL: row returns G_t = r_t + 0.5 G_{t+1}: [0.5, 1] | [0] | [1.5, 3] | [-, 3] (score on the last)
    cfg = _cfg(advantage="reinforce_pp", group_size=2, gamma=0.5)
    adv, _ = ESTIMATORS[cfg.advantage](Signals(TOK_SCORES, TOK_MASK), cfg)
    _close(adv, _place(_whiten([0.5, 1.0, 0.0, 1.5, 3.0, 3.0])))
    # the baseline's centred scores [0.5, -0.5, 0, 0] with gamma 0.5: [0.25, 0.5] | [-0.5] | [0, 0] | [-, 0]
    cfg = _cfg(advantage="reinforce_pp_baseline", group_size=2, gamma=0.5)
    adv, _ = ESTIMATORS[cfg.advantage](Signals(TOK_SCORES, TOK_MASK), cfg)
    _close(adv, _place(_whiten([0.25, 0.5, -0.5, 0.0, 0.0, 0.0])))


# ---------------------------------------------------------------- gae (PPO with a critic)
#
# B = 2, C = 2, kl_coef 0.5 in the reward, gamma 1, lambda 0.5. Token rewards as above:
# row 0: mask [1, 1], kl [0.2, 0.4], score 1 -> r = [-0.1, 0.8]; values [0.5, 0.6]
#   t=1: delta = 0.8 + 0 - 0.6 = 0.2,          A_1 = 0.2,                    R_1 = 0.2 + 0.6 = 0.8
#   t=0: delta = -0.1 + 0.6 - 0.5 = 0.0,       A_0 = 0.0 + 1 * 0.5 * 0.2 = 0.1, R_0 = 0.1 + 0.5 = 0.6
# row 1: mask [1, 0], kl [0.6, 9], score 0 -> r = [-0.3, -]; values [0.1, 7 (off the mask: skipped)]
#   t=0: delta = -0.3 + 0 - 0.1 = -0.4,        A_0 = -0.4,                   R_0 = -0.3
# advantages whitened over the masked [0.1, 0.2, -0.4]; returns raw.


def test_gae_estimator_with_kl_in_the_reward():
    cfg = _cfg(advantage="gae", gae_lambda=0.5, kl_coef=0.5, kl_in="reward")
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6], [0.1, 7.0]])
    signals = Signals(torch.tensor([1.0, 0.0]), mask, torch.tensor([[0.2, 0.4], [0.6, 9.0]]), 0.5, values)
    adv, returns = ESTIMATORS[cfg.advantage](signals, cfg)
    a = _whiten([0.1, 0.2, -0.4])
    _close(adv, [[a[0], a[1]], [a[2], 0.0]])
    assert returns is not None
    _close(returns, [[0.6, 0.8], [-0.3, 0.0]])


def test_gae_needs_values():
    cfg = _cfg(advantage="gae")
    with pytest.raises(ValueError, match="^grpo.advantage 'gae' needs critic values$"):
        ESTIMATORS["gae"](Signals(torch.tensor([1.0]), torch.ones(1, 1)), cfg)


def test_every_configurable_estimator_is_pinned_here():
    # a new grpo.advantage value must get a pinned test in this file
    assert set(ESTIMATORS) == set(GRPOConfig.model_fields["advantage"].annotation.__args__)
    assert set(ESTIMATORS) == {*OUTCOME_EXPECTED, "reinforce_pp", "reinforce_pp_baseline", "gae"}


# ---------------------------------------------------------------- policy losses: grpo_loss(cfg).policy_loss
#
# B = 2, C = 2, mask [[1, 1], [1, 0]], advantages [1, -1] per sequence, ratios r = exp(logp - old):
#   row 0 (A = +1): r = [1.5, 0.9];  row 1 (A = -1): r = [5.0, 3.0 (off the mask)]
# PPO token loss L = -min(r A, clip(r, 1 - lo, 1 + hi) A), clip 0.2 / 0.2:
#   row 0: -min(1.5, 1.2) = -1.2;  -min(0.9, 0.9) = -0.9
#   row 1: -min(-5, -1.2) = 5
# token_mean   = (-1.2 - 0.9 + 5) / 3 = 2.9 / 3
# seq_mean     = mean(-2.1 / 2, 5) = (-1.05 + 5) / 2 = 1.975
# fixed_length = 2.9 / (B * max_new_tokens) = 2.9 / (2 * 4) = 0.3625
# clip-higher (hi 0.28): row 0 t0: -min(1.5, 1.28) = -1.28 -> token_mean (-1.28 - 0.9 + 5) / 3 = 2.82 / 3
# dual clip c = 3: row 1 (A < 0): min(5, -3 * -1) = 3 -> token_mean (-1.2 - 0.9 + 3) / 3 = 0.3
# GSPO: sequence ratio s = exp(mean over masked tokens of log r): row 0 sqrt(1.5 * 0.9) = sqrt(1.35),
#   row 1 5; with clip 3e-4 / 4e-4: row 0 -min(sqrt1.35, 1.0004) = -1.0004, row 1 -min(-5, -0.9997) = 5,
#   seq_mean (5 - 1.0004) / 2 = 1.9998; token_mean spreads each over its tokens: (2 * -1.0004 + 5) / 3
#   with clip 0.2 / 0.2: row 0 -min(sqrt1.35, 1.2) = -sqrt(1.35) -> seq_mean (5 - sqrt1.35) / 2

OLD = torch.full((2, 2), math.log(0.3))
LOGP = OLD + torch.log(torch.tensor([[1.5, 0.9], [5.0, 3.0]]))
ADV = torch.tensor([1.0, -1.0])
LOSS_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])

LOSS_CASES = [
    ({}, 2.9 / 3),
    ({"loss_agg": "seq_mean"}, 1.975),
    ({"loss_agg": "fixed_length"}, 0.3625),
    ({"clip_high": 0.28}, 2.82 / 3),
    ({"dual_clip": 3.0}, 0.3),
    ({"dual_clip": 3.0, "loss_agg": "seq_mean"}, (-1.05 + 3.0) / 2),
    ({"policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "loss_agg": "seq_mean"}, (5 - 1.0004) / 2),
    ({"policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4}, (5 - 2 * 1.0004) / 3),
    ({"policy_loss": "gspo", "loss_agg": "seq_mean"}, (5 - math.sqrt(1.35)) / 2),
    ({"policy_loss": "gspo", "loss_agg": "fixed_length"}, (5 - 2 * math.sqrt(1.35)) / 8),
]


@pytest.mark.parametrize(
    ("fields", "expected"), LOSS_CASES, ids=lambda v: str(v) if isinstance(v, dict) else ""
)
def test_policy_loss_variants(fields, expected):
    cfg = _cfg(sampling=SamplingConfig(max_new_tokens=4), **fields)
    out = grpo_loss(cfg).policy_loss(LOGP, OLD, ADV, LOSS_MASK)
    torch.testing.assert_close(out.loss, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_policy_loss_clip_low_comes_from_the_config():
    # clip_low 0.5 with A < 0 and r = 0.4: -min(-0.4, -0.5) = 0.5 (with the default 0.2 it would be 0.8)
    cfg = _cfg(clip_low=0.5)
    old = torch.zeros(1, 1)
    out = grpo_loss(cfg).policy_loss(old + math.log(0.4), old, torch.tensor([-1.0]), torch.ones(1, 1))
    torch.testing.assert_close(out.loss, torch.tensor(0.5))
    assert float(out.clip_fraction) == 1.0
