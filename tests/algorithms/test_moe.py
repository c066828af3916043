"""Router health maths (loopline.algorithms.moe): hand-computed values, and the load-balancing loss against
transformers' own (Qwen3-MoE's and Mixtral's load_balancing_loss_func) with and without padding."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_loss
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as qwen3_moe_loss

from loopline.algorithms.moe import (
    coefficient_of_variation,
    expert_counts,
    load_balancing_loss,
    router_prob_sums,
)

pytestmark = pytest.mark.unit


def test_hand_computed_counts_cv_and_loss():
    # 4 tokens, 2 experts, top-1: experts 0, 0, 1, 0; the last token is padding
    chosen = torch.tensor([[0], [0], [1], [0]])
    mask = torch.tensor([1, 1, 1, 0])
    counts = expert_counts(chosen, 2, mask)
    assert counts.tolist() == [2.0, 1.0]
    # mean 1.5, population std 0.5: CV = 1/3
    assert float(coefficient_of_variation(counts)) == pytest.approx(1 / 3)
    # router probabilities 0.6 / 0.4 on every token: f = (2/3, 1/3), P = (0.6, 0.4)
    # E * sum f P = 2 * (2/3 * 0.6 + 1/3 * 0.4) = 2 * (0.4 + 0.1333) = 1.0667
    logits = torch.log(torch.tensor([[0.6, 0.4]] * 4))
    sums = router_prob_sums(logits, mask)
    assert sums.tolist() == pytest.approx([1.8, 1.2])
    assert float(load_balancing_loss(counts, sums, mask.sum())) == pytest.approx(
        2 * (2 / 3 * 0.6 + 1 / 3 * 0.4)
    )


def test_cv_bounds():
    assert float(coefficient_of_variation(torch.full((8,), 5.0))) == 0.0  # perfectly balanced
    one = torch.zeros(8)
    one[3] = 40.0
    assert float(coefficient_of_variation(one)) == pytest.approx(math.sqrt(7))  # all on one expert
    assert float(coefficient_of_variation(torch.zeros(8))) == 0.0  # no tokens
    assert coefficient_of_variation(torch.stack([one, torch.ones(8)])).tolist() == pytest.approx(
        [math.sqrt(7), 0]
    )


@pytest.mark.parametrize("hf_loss", [qwen3_moe_loss, mixtral_loss])
@pytest.mark.parametrize("padded", [False, True])
def test_pooled_loss_equals_transformers(hf_loss, padded):
    g = torch.Generator().manual_seed(0)
    layers, batch, seq, experts, k = 3, 4, 5, 16, 4
    logits = tuple(torch.randn(batch * seq, experts, generator=g, dtype=torch.float64) for _ in range(layers))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[0, :2] = 0
        mask[2, :4] = 0
    expected = hf_loss(logits, experts, k, mask if padded else None)
    flat = mask.reshape(-1) if padded else None
    chosen = [torch.topk(torch.softmax(x, -1), k, dim=-1).indices for x in logits]
    counts = sum(expert_counts(c, experts, flat) for c in chosen)
    probs = sum(router_prob_sums(x, flat) for x in logits)
    tokens = layers * (int(mask.sum()) if padded else batch * seq)
    got = load_balancing_loss(counts, probs.double(), tokens)
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    # one layer alone: the same definition at L = 1
    one = load_balancing_loss(
        expert_counts(chosen[1], experts, flat), router_prob_sums(logits[1], flat), tokens // layers
    )
    assert float(one) == pytest.approx(
        float(hf_loss(logits[1:2], experts, k, mask if padded else None)), rel=1e-6
    )


def test_gradient_flows_through_the_probabilities_only():
    logits = torch.randn(6, 4, requires_grad=True)
    chosen = torch.topk(logits, 2, dim=-1).indices
    loss = load_balancing_loss(expert_counts(chosen, 4), router_prob_sums(logits), 6)
    (grad,) = torch.autograd.grad(loss, logits)
    # d/dlogits of E * sum_e f_e * mean_t softmax(logits_t)_e, by hand through the softmax
    f = expert_counts(chosen, 4) / 6
    p = torch.softmax(logits.detach(), -1)
    dp = 4 * f / 6  # d loss / d p_te
    expected = p * (dp - (p * dp).sum(-1, keepdim=True))
    assert torch.allclose(grad, expected, atol=1e-6)
