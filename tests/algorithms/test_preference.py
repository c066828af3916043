"""DPO variants and the Bradley-Terry reward-model loss against hand-computed values.

Shared pair: policy chosen -10, rejected -14; reference chosen -11, rejected -12; beta .1.
  chosen log-ratio 1, rejected log-ratio -2, delta = 3, beta * delta = .3
  -logsigmoid(.3) = log(1 + e^-.3) = log(1.740818) = .554355; -logsigmoid(-.3) = .554355 + .3 = .854355
"""

from __future__ import annotations

import math

import pytest
import torch

from loopline.algorithms.preference import (
    bradley_terry_loss,
    dpo_hinge_loss,
    dpo_ipo_loss,
    dpo_robust_loss,
    dpo_sigmoid_loss,
)

PC, PR, RC, RR = (torch.tensor([v], dtype=torch.float64) for v in (-10.0, -14.0, -11.0, -12.0))
L = math.log1p(math.exp(-0.3))  # .554355


def test_sigmoid_loss_and_rewards():
    out = dpo_sigmoid_loss(PC, PR, RC, RR, beta=0.1)
    assert float(out.loss) == pytest.approx(L, abs=1e-12)
    # implicit rewards: beta * log-ratio = .1 and -.2
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.1], dtype=torch.float64))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.2], dtype=torch.float64))
    loss, chosen, rejected = out  # unpacks like a tuple
    assert loss is out.loss


def test_conservative_dpo_label_smoothing():
    # .9 * L + .1 * (L + .3) = L + .03
    out = dpo_sigmoid_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.1)
    assert float(out.loss) == pytest.approx(L + 0.03, abs=1e-12)


def test_robust_loss():
    # [.9 L - .1 (L + .3)] / .8 = L - .03/.8 = L - .0375
    out = dpo_robust_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.1)
    assert float(out.loss) == pytest.approx(L - 0.0375, abs=1e-12)
    # e = 0 is plain DPO
    assert float(dpo_robust_loss(PC, PR, RC, RR, 0.1, 0.0).loss) == pytest.approx(L, abs=1e-12)
    with pytest.raises(ValueError, match="label_smoothing < 0.5"):
        dpo_robust_loss(PC, PR, RC, RR, 0.1, 0.5)


def test_hinge_loss_batch():
    # pair 1: relu(1 - .3) = .7; pair 2: delta 20 -> relu(1 - 2) = 0; mean .35
    pc, pr = torch.tensor([-10.0, 0.0]), torch.tensor([-14.0, -20.0])
    rc, rr = torch.tensor([-11.0, 0.0]), torch.tensor([-12.0, 0.0])
    out = dpo_hinge_loss(pc, pr, rc, rr, beta=0.1)
    assert float(out.loss) == pytest.approx(0.35, abs=1e-6)


def test_ipo_length_normalised():
    # |c| = 2, |r| = 4: 1/2 - (-2)/4 = 1; 1/(2 beta) = 5 -> (1 - 5)^2 = 16
    out = dpo_ipo_loss(PC, PR, RC, RR, torch.tensor([2]), torch.tensor([4]), beta=0.1)
    assert float(out.loss) == pytest.approx(16.0, abs=1e-12)
    # zero lengths clamp to 1: 1 - (-2) = 3 -> (3 - 5)^2 = 4
    out = dpo_ipo_loss(PC, PR, RC, RR, torch.tensor([0]), torch.tensor([0]), beta=0.1)
    assert float(out.loss) == pytest.approx(4.0, abs=1e-12)


def test_dpo_gradient_direction():
    # the loss falls as the chosen log-prob rises and the rejected one falls
    pc, pr = PC.clone().requires_grad_(True), PR.clone().requires_grad_(True)
    dpo_sigmoid_loss(pc, pr, RC, RR).loss.backward()
    # d/dpc -logsig(beta delta) = -beta * sigmoid(-beta delta) = -.1 * sigmoid(-.3)
    expected = 0.1 / (1 + math.exp(0.3))
    assert float(pc.grad) == pytest.approx(-expected, abs=1e-12)
    assert float(pr.grad) == pytest.approx(expected, abs=1e-12)


def test_bradley_terry():
    rc = torch.tensor([2.0, 0.0], dtype=torch.float64)
    rr = torch.tensor([1.0, 0.0], dtype=torch.float64)
    # diffs [1, 0]: (log(1 + e^-1) + log 2)/2 = (.313262 + .693147)/2
    base = (math.log1p(math.exp(-1)) + math.log(2)) / 2
    assert float(bradley_terry_loss(rc, rr)) == pytest.approx(base, abs=1e-12)
    # margin [1, 0]: diffs [0, 0] -> log 2
    margin = torch.tensor([1.0, 0.0], dtype=torch.float64)
    assert float(bradley_terry_loss(rc, rr, margin)) == pytest.approx(math.log(2), abs=1e-12)
    # centring .01 * mean([3^2, 0^2]) = .01 * 4.5 = .045
    assert float(bradley_terry_loss(rc, rr, center_coef=0.01)) == pytest.approx(base + 0.045, abs=1e-12)
