"""Property-based tests (Hypothesis) of the advantage estimators and the loss aggregation.

Invariants that hold for any input, checked on random ones:
- grpo, dr_grpo and rloo advantages sum to 0 within every prompt group (with or without KL in the reward),
  and rloo = n / (n - 1) * dr_grpo; the token-level estimators are whitened (masked mean 0, std 1).
- A loss aggregated over micro-batches with the trainer's weights (training.policy._share) equals the loss
  of the whole batch, for every aggregation and every micro-batch size.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopline.algorithms.advantages import (
    dr_grpo_advantages,
    group_advantages,
    masked_whiten,
    rloo_advantages,
)
from loopline.algorithms.losses import aggregate, clipped_policy_loss
from loopline.config import GRPOConfig
from loopline.data.batches import RolloutBatch, split_rows
from loopline.loops.estimators import ESTIMATORS, Signals
from loopline.training.policy import _share

SETTINGS = settings(max_examples=60, deadline=None)
# two decimals: sums of these never come within float noise of each other unless they are equal
FLOATS = st.floats(-5.0, 5.0, allow_nan=False, allow_infinity=False).map(lambda x: round(x, 2))


@st.composite
def grouped_batches(draw, min_group: int = 2):
    """(scores (B,), mask (B, C), kl (B, C), kl_coef, group_size) in float64; every row has a token."""
    n = draw(st.integers(min_group, 5))
    groups = draw(st.integers(1, 4))
    width = draw(st.integers(1, 4))
    b = n * groups
    scores = torch.tensor(draw(st.lists(FLOATS, min_size=b, max_size=b)), dtype=torch.float64)
    bits = draw(st.lists(st.booleans(), min_size=b * width, max_size=b * width))
    mask = torch.tensor(bits, dtype=torch.float64).view(b, width)
    mask[:, 0] = 1.0  # at least one trained token per row
    kl = torch.tensor(draw(st.lists(FLOATS, min_size=b * width, max_size=b * width)), dtype=torch.float64)
    kl_coef = draw(st.sampled_from([0.0, 0.05, 0.5]))
    return scores, mask, kl.view(b, width).abs(), kl_coef, n


def _group_sums(adv: torch.Tensor, n: int) -> torch.Tensor:
    return adv.view(-1, n).sum(dim=1)


@SETTINGS
@given(
    grouped_batches(),
    st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    st.sampled_from(["group", "batch", "none"]),
)
def test_outcome_advantages_are_zero_mean_in_every_group(batch, advantage, scale):
    scores, mask, kl, kl_coef, n = batch
    cfg = GRPOConfig(advantage=advantage, group_size=n, adv_scale=scale)
    adv, _ = ESTIMATORS[advantage](Signals(scores, mask, kl, kl_coef), cfg)
    assert adv.shape == scores.shape
    torch.testing.assert_close(_group_sums(adv, n), torch.zeros(len(scores) // n, dtype=adv.dtype))


@SETTINGS
@given(grouped_batches())
def test_rloo_is_dr_grpo_scaled_and_grpo_is_dr_grpo_over_the_group_std(batch):
    scores, mask, kl, kl_coef, n = batch
    centred = dr_grpo_advantages(scores, n)
    torch.testing.assert_close(rloo_advantages(scores, n), centred * n / (n - 1))
    std = scores.view(-1, n).std(dim=1, keepdim=True)  # Bessel, as TRL
    torch.testing.assert_close(
        group_advantages(scores, n, eps=0.25), (centred.view(-1, n) / (std + 0.25)).view(-1)
    )
    # the KL enters the outcome estimators only through the sequence reward score - kl_coef * sum_t kl_t
    cfg = GRPOConfig(advantage="rloo", group_size=n)
    adv, _ = ESTIMATORS["rloo"](Signals(scores, mask, kl, kl_coef), cfg)
    torch.testing.assert_close(adv, rloo_advantages(scores - kl_coef * (kl * mask).sum(1), n))


@SETTINGS
@given(grouped_batches(), st.sampled_from(["reinforce_pp", "reinforce_pp_baseline"]))
def test_token_level_advantages_are_whitened_over_the_mask(batch, advantage):
    scores, mask, kl, kl_coef, n = batch
    cfg = GRPOConfig(advantage=advantage, group_size=n, gamma=0.9)
    adv, _ = ESTIMATORS[advantage](Signals(scores, mask, kl, kl_coef), cfg)
    assert adv.shape == mask.shape
    assert torch.all(adv[mask == 0] == 0)
    values = adv[mask == 1]
    assert abs(float(values.mean())) < 1e-6
    std = float(values.std(unbiased=False))
    assert std < 1e-6 or abs(std - 1.0) < 1e-3  # all-equal returns whiten to 0; eps 1e-8 shaves the rest


@SETTINGS
@given(st.lists(FLOATS, min_size=1, max_size=12), st.data())
def test_masked_whiten_ignores_what_is_off_the_mask(values, data):
    x = torch.tensor(values, dtype=torch.float64)[None]
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values))))[None]
    noise = x + 100.0 * (~mask)  # changing the off-mask entries changes nothing
    torch.testing.assert_close(masked_whiten(x, mask), masked_whiten(noise, mask))


# ---------------------------------------------------------------- micro-batch accumulation


@st.composite
def rollouts(draw):
    """A RolloutBatch (float64 advantages, per-token values in old_logprobs) and a micro-batch size."""
    b = draw(st.integers(1, 7))
    width = draw(st.integers(1, 5))
    bits = draw(st.lists(st.booleans(), min_size=b * width, max_size=b * width))
    mask = torch.tensor(bits, dtype=torch.float64).view(b, width)
    if draw(st.booleans()):
        mask[:, 0] = 1.0
    values = torch.tensor(draw(st.lists(FLOATS, min_size=b * width, max_size=b * width)), dtype=torch.float64)
    adv = torch.tensor(draw(st.lists(FLOATS, min_size=b, max_size=b)), dtype=torch.float64)
    ids = torch.zeros(b, width + 1, dtype=torch.long)
    batch = RolloutBatch(ids, torch.ones_like(ids), mask, values.view(b, width), None, adv, torch.zeros(b))
    return batch, draw(st.integers(1, b))


AGGS = st.sampled_from(["token_mean", "seq_mean", "fixed_length"])


def _totals(batch) -> tuple[float, float]:
    return float(batch.response_mask.sum()), float(len(batch))


@SETTINGS
@given(rollouts(), AGGS)
def test_share_weighted_micro_batches_equal_the_whole_batch(rollout, agg):
    batch, micro = rollout
    whole = aggregate(batch.old_logprobs, batch.response_mask, agg, max_len=8)
    parts = [
        aggregate(m.old_logprobs, m.response_mask, agg, max_len=8) * _share(m, _totals(batch), agg)
        for m in split_rows(batch, micro)
    ]
    torch.testing.assert_close(sum(parts), whole)


@SETTINGS
@given(rollouts(), AGGS, st.floats(-1.0, 1.0))
def test_policy_loss_and_its_gradient_accumulate_exactly(rollout, agg, shift):
    # the policy loss itself, with its gradient, through the trainer's weights
    batch, micro = rollout
    logp = (batch.old_logprobs * 0.1 + shift).requires_grad_(True)
    old = batch.old_logprobs * 0.1

    def loss(rows: slice, mask, adv) -> torch.Tensor:
        return clipped_policy_loss(logp[rows], old[rows], adv, mask, agg=agg, max_len=8).loss

    whole = loss(slice(None), batch.response_mask, batch.advantages)
    (grad_whole,) = torch.autograd.grad(whole, logp)
    total = 0.0
    for i, m in enumerate(split_rows(batch, micro)):
        rows = slice(i * micro, i * micro + len(m))
        total = total + loss(rows, m.response_mask, m.advantages) * _share(m, _totals(batch), agg)
    (grad_parts,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(grad_parts, grad_whole)
