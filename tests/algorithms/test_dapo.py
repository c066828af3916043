"""DAPO's dynamic sampling filter, overlong reward shaping and truncated-row masking, by hand."""

from __future__ import annotations

import pytest
import torch

from loopline.algorithms.dapo import informative_groups, mask_truncated, overlong_penalty
from loopline.algorithms.losses import clipped_policy_loss


def test_informative_groups():
    # groups of 3: [1, 1, 1] all equal -> drop; [0, 1, 0] -> keep; [0, 0, 0] -> drop; [2, 2, 2.5] -> keep
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.5])
    assert informative_groups(rewards, 3).tolist() == [False, True, False, True]


def test_informative_groups_tolerance_single_group_and_group_of_one():
    near = torch.tensor([0.5, 0.5 + 1e-9], dtype=torch.float64)
    assert informative_groups(near, 2).tolist() == [True]  # exact by default
    assert informative_groups(near, 2, atol=1e-6).tolist() == [False]
    assert informative_groups(torch.tensor([3.0]), 1).tolist() == [False]  # one sample has no spread
    with pytest.raises(ValueError, match="group_size=4"):
        informative_groups(torch.zeros(6), 4)


def test_overlong_penalty():
    # L_max 20, L_cache 4: free up to 16 tokens, then -(|y| - 16)/4, floored at -1 from 20 on
    # lengths [10, 16, 17, 18, 20, 25] -> [0, 0, -.25, -.5, -1, -1]
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    torch.testing.assert_close(
        overlong_penalty(lengths, max_len=20, cache_len=4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    )
    # penalty .5 scales it: 18 tokens -> -.25
    torch.testing.assert_close(
        overlong_penalty(torch.tensor([18]), 20, 4, penalty=0.5), torch.tensor([-0.25])
    )


def test_overlong_penalty_rejects_bad_cache():
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([3]), max_len=10, cache_len=0)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([3]), max_len=10, cache_len=11)


def test_mask_truncated_zeroes_rows_that_hit_the_limit():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    truncated = torch.tensor([True, False, False])
    got = mask_truncated(mask, truncated)
    assert torch.equal(got, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert got.dtype == mask.dtype
    # an integer mask stays integer
    assert mask_truncated(mask.long(), truncated).dtype == torch.long


def test_truncated_row_contributes_nothing_to_the_loss():
    # row 0 (truncated) has a huge advantage; after masking, the loss is row 1's alone:
    # ratio 1, A = -1 on 2 tokens -> token mean 1; and row 0 gets no gradient
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = mask_truncated(torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]), torch.tensor([True, False]))
    out = clipped_policy_loss(logp, logp.detach(), torch.tensor([100.0, -1.0]), mask)
    torch.testing.assert_close(out.loss, torch.tensor(1.0))
    out.loss.backward()
    assert torch.equal(logp.grad[0], torch.zeros(3))
