"""Reward-model score whitening and clipping, by hand."""

from __future__ import annotations

import pytest
import torch

from loopline.algorithms.reward import whiten_clip


def test_whiten_clip_by_hand():
    # [1, 2, 3, 6]: mean 3, centred [-2, -1, 0, 3], population var (4 + 1 + 0 + 9) / 4 = 3.5
    s = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    std = 3.5**0.5
    expected = torch.tensor([-2.0, -1.0, 0.0, 3.0], dtype=torch.float64) / std
    assert torch.allclose(whiten_clip(s, eps=0.0), expected)
    # clip 1.5: 3 / 1.8708 = 1.604 -> 1.5, -2 / 1.8708 = -1.069 stays
    clipped = whiten_clip(s, clip=1.5, eps=0.0)
    assert clipped.tolist() == pytest.approx([-2 / std, -1 / std, 0.0, 1.5])
    # shift and scale of the raw scores do not matter
    assert torch.allclose(whiten_clip(10 * s - 7, eps=0.0), expected)


def test_whiten_clip_edge_cases():
    assert whiten_clip(torch.tensor([4.0])).tolist() == [0.0]  # a batch of one
    assert whiten_clip(torch.full((3,), -2.5)).tolist() == [0.0, 0.0, 0.0]  # all equal
    with pytest.raises(ValueError, match="non-empty 1-D"):
        whiten_clip(torch.zeros(0))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        whiten_clip(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="clip must be > 0"):
        whiten_clip(torch.ones(2), clip=0.0)
