"""logprob_mismatch: the engine's sampled log-probs against the trainer's, as a k3 KL and a max-abs."""

from __future__ import annotations

import math

import pytest
import torch

from loopline.algorithms.losses import logprob_mismatch


@pytest.mark.unit
def test_mismatch_by_hand() -> None:
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -9.0]])
    engine = torch.tensor([[-1.1, -2.0, -0.5], [-2.8, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the -9 vs -1 token is padding: left out
    kl, max_abs = logprob_mismatch(trainer, engine, mask)
    # log(trainer / engine) on the mask: 0.1, 0, 0, -0.2, 0; k3 = e^x - 1 - x, mean over the 5 tokens
    want = ((math.exp(0.1) - 1.1) + (math.exp(-0.2) - 0.8)) / 5
    assert kl == pytest.approx(want, rel=1e-5)
    assert max_abs == pytest.approx(0.2, rel=1e-5)


@pytest.mark.unit
def test_no_mismatch_when_both_compute_the_same() -> None:
    logp = -torch.rand(4, 6)
    assert logprob_mismatch(logp, logp.clone(), torch.ones(4, 6)) == (0.0, 0.0)
