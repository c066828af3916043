"""RouterStats (loopline.training.router) on the scaled-down Qwen3-MoE: what its hooks read equals transformers'
own router outputs and auxiliary loss for the same forward; padding, no-grad forwards and checkpointed
recomputes are left out; the coefficient's gradient; dense models get nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from loopline.algorithms.moe import coefficient_of_variation, expert_counts
from loopline.training.parallel import apply_activation_checkpointing
from loopline.training.router import RouterStats, aux_loss_coef
from tests.moe import tiny_moe

pytestmark = pytest.mark.unit


def _batch(seed: int = 0, rows: int = 3, width: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 259, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def test_metrics_equal_transformers_router_outputs_over_the_real_tokens():
    model = tiny_moe()
    stats = RouterStats(model)
    ids, mask = _batch()
    out = model(input_ids=ids, attention_mask=mask, use_cache=False, output_router_logits=True)
    stats.objective(out.logits.sum())
    row = stats.metrics()
    real = mask.reshape(-1)
    for layer, logits in enumerate(out.router_logits):  # (rows * width, 128) per layer, padding included
        chosen = torch.topk(torch.softmax(logits, -1), 8, dim=-1).indices
        cv = coefficient_of_variation(expert_counts(chosen, 128, real))
        assert row[f"router_cv_layer{layer}"] == pytest.approx(float(cv), rel=1e-6)
    assert row["router_cv"] == pytest.approx((row["router_cv_layer0"] + row["router_cv_layer1"]) / 2)
    # transformers' auxiliary loss of this forward (padding masked out, pooled over the layers)
    assert row["router_aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert stats.metrics()["router_cv"] == 0.0  # reset: the next step starts empty


def test_the_aux_term_and_its_gradient_are_coef_times_transformers_loss():
    model = tiny_moe()
    reference = copy.deepcopy(model)
    ids, mask = _batch()
    stats = RouterStats(model, coef=0.25)
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    zero = out.logits.sum() * 0.0
    term = stats.objective(zero)
    term.backward()
    ref = reference(input_ids=ids, attention_mask=mask, output_router_logits=True)
    (0.25 * ref.aux_loss).backward()
    assert float(term.detach()) == pytest.approx(0.25 * float(ref.aux_loss), rel=1e-5)
    gate = "model.layers.1.mlp.gate.weight"
    got, expected = model.get_parameter(gate).grad, reference.get_parameter(gate).grad
    assert expected.abs().max() > 0
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-9)


def test_no_grad_and_eval_forwards_are_not_counted():
    model = tiny_moe()
    stats = RouterStats(model)
    ids, mask = _batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    model.eval()
    model(input_ids=ids, attention_mask=mask, use_cache=False)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum()
    assert stats.objective(loss) is loss  # coefficient 0: the loss itself
    assert float(stats._tokens.sum()) == 2 * float(mask.sum())  # one forward's real tokens, in both layers


def test_a_checkpointed_layers_recompute_is_not_counted_again():
    rows = []
    for checkpointing in ("none", "full"):
        model = tiny_moe()
        apply_activation_checkpointing(model, checkpointing)
        stats = RouterStats(model)
        for seed in (0, 1):  # two micro-batches: a recompute in the first backward would land in the second
            ids, mask = _batch(seed)
            stats.objective(
                model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum()
            ).backward()
        rows.append(stats.metrics())
    assert rows[0] == pytest.approx(rows[1], rel=1e-6)


def test_a_second_trainer_on_the_same_model_does_not_double_the_hooks():
    model = tiny_moe()
    RouterStats(model)
    stats = RouterStats(model)  # the next phase's trainer
    ids, mask = _batch()
    stats.objective(model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum())
    assert float(stats._tokens.sum()) == 2 * float(mask.sum())


def test_default_coefficient_is_what_transformers_trains_with(small_model):
    assert aux_loss_coef(tiny_moe(), None) == 0.0  # the published config: output_router_logits false
    assert aux_loss_coef(tiny_moe(output_router_logits=True), None) == 0.001  # then its router_aux_loss_coef
    assert aux_loss_coef(tiny_moe(), 0.5) == 0.5
    dense = RouterStats(small_model)
    loss = small_model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum()
    assert dense.objective(loss) is loss and dense.metrics() == {}
    with pytest.raises(ValueError, match="model.router_aux_loss_coef=0.1: Qwen2ForCausalLM has no router"):
        RouterStats(small_model, 0.1)
