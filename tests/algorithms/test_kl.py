"""KL as a per-token reward penalty, and the fixed and adaptive KL controllers, against hand values."""

from __future__ import annotations

import pytest
import torch

from loopline.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_penalty_rewards,
    last_token_index,
)

MASK = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 2: all padding
SCORES = torch.tensor([1.0, 2.0, 3.0])
KL = torch.tensor([[0.5, 0.2, 9.0], [1.0, 0.4, 0.3], [1.0, 1.0, 1.0]])


def test_last_token_index():
    # row 0 ends at t=1, row 1 at t=2, row 2 has no token
    assert last_token_index(MASK).tolist() == [1, 2, -1]


def test_kl_penalty_rewards():
    # r_t = -.1 * kl_t on masked tokens, + score on the last one:
    # row 0: [-.05, -.02 + 1, 0] = [-.05, .98, 0]   (kl 9 at the pad is ignored)
    # row 1: [0, -.04, -.03 + 2] = [0, -.04, 1.97]
    # row 2: nothing to carry the score -> zeros
    got = kl_penalty_rewards(SCORES, MASK, KL, kl_coef=0.1)
    expected = torch.tensor([[-0.05, 0.98, 0.0], [0.0, -0.04, 1.97], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(got, expected)


def test_kl_penalty_rewards_without_kl_place_scores_only():
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(kl_penalty_rewards(SCORES, MASK), expected)
    torch.testing.assert_close(kl_penalty_rewards(SCORES, MASK, KL, kl_coef=0.0), expected)


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    assert ctl.update(current_kl=100.0, n_steps=64) == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_moves_towards_target():
    # target 6, horizon 10000, 256 samples per update, start .1:
    # KL 9: error clip(9/6 - 1 = .5, -.2, .2) = .2 -> .1 * (1 + .2 * 256/10000) = .1 * 1.00512 = .100512
    # KL 3: error clip(-.5) = -.2 -> .100512 * (1 - .00512) = .100512 * .99488
    # KL 6: error 0 -> unchanged
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert ctl.update(9.0, 256) == pytest.approx(0.100512, rel=1e-12)
    assert ctl.update(3.0, 256) == pytest.approx(0.100512 * 0.99488, rel=1e-12)
    assert ctl.update(6.0, 256) == pytest.approx(0.100512 * 0.99488, rel=1e-12)
    # a small error is not clipped: KL 6.6 -> error .1 -> * (1 + .1 * .0256)
    before = ctl.value
    assert ctl.update(6.6, 256) == pytest.approx(before * 1.00256, rel=1e-12)


def test_adaptive_controller_state_round_trip():
    ctl = AdaptiveKLController(0.2, target=1.0, horizon=100)
    ctl.update(2.0, 10)
    resumed = AdaptiveKLController(0.0, target=5.0, horizon=7)
    resumed.load_state_dict(ctl.state_dict())
    # the resumed controller continues exactly as the original would
    assert resumed.update(0.5, 10) == ctl.update(0.5, 10)
    assert (resumed.target, resumed.horizon) == (1.0, 100)


def test_adaptive_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon > 0"):
        AdaptiveKLController(0.1, target=1.0, horizon=0)
