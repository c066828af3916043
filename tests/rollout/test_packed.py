"""Decoding on oneDNN-reordered linear weights (rollout/packed.py): the same products and tokens as the plain
weights, packed only while a call generates, packed again when new weights arrive mid-call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from loopline.rollout.config import PACK_MIN_NEW_TOKENS
from loopline.rollout.engine import SamplingParams, TorchEngine
from loopline.rollout.packed import PackedLinears, _ops_available

pytestmark = pytest.mark.skipif(not _ops_available(), reason="this torch build has no oneDNN linear ops")


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_packed_products_equal_the_plain_ones_and_closing_restores_the_layer():
    torch.manual_seed(0)
    layer = nn.Linear(96, 200)
    x = torch.randn(3, 16, 96)  # (B, T, in): the engine's inputs are batched sequences
    plain = layer(x)
    exact = (x.double() @ layer.weight.double().T + layer.bias.double()).float()
    with PackedLinears(layer, rows=16) as packed:
        assert packed.layers == [layer] and "forward" in layer.__dict__
        got = layer(x)
    assert got.shape == plain.shape
    # both are float32 sums of 96 products: each within float rounding of the exact one
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))
    assert "forward" not in layer.__dict__ and torch.equal(layer(x), plain)


def test_only_plain_float32_layers_without_hooks_are_packed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).double(), nn.Linear(8, 8))
    model[2].register_forward_pre_hook(
        lambda m, a: None
    )  # e.g. a cast that swaps the weight: it must still run
    assert PackedLinears(model, rows=4).layers == [model[0]]


def _packed_during_calls(engine: TorchEngine) -> tuple[list[bool], torch.utils.hooks.RemovableHandle]:
    """Whether the head was packed at each forward of the engine's model (a hook on the root, not the layers)."""
    seen: list[bool] = []
    head = engine.model.get_output_embeddings()
    handle = engine.model.register_forward_pre_hook(lambda m, a: seen.append("forward" in head.__dict__))
    return seen, handle


@pytest.mark.parametrize("max_rows", [0, 4])
def test_greedy_tokens_are_those_of_the_plain_weights(small_model, tokenizer, max_rows):
    prompts = [tokenizer(t)["input_ids"] for t in ["7+5=", "12+30=", "4+91=", "3+3="]]
    params = SamplingParams(max_new_tokens=PACK_MIN_NEW_TOKENS + 4, temperature=0.0, ignore_eos=True)
    runs = {}
    for pack in (False, True):
        engine = TorchEngine(small_model, tokenizer, max_rows=max_rows, pack_weights=pack)
        seen, handle = _packed_during_calls(engine)
        try:
            runs[pack] = engine.generate(prompts, params, n=2)
        finally:
            handle.remove()
        assert seen and all(s == pack for s in seen)  # every forward of the call, prefill and decode
    assert not any("forward" in m.__dict__ for m in _linears(small_model))  # the copies went with the call
    for plain, packed in zip(runs[False], runs[True], strict=True):
        assert packed.token_ids == plain.token_ids and len(plain.token_ids) == params.max_new_tokens
        assert packed.logprobs == pytest.approx(plain.logprobs, abs=1e-5)


def test_a_short_call_does_not_pack(small_model, tokenizer):
    engine = TorchEngine(small_model, tokenizer)
    seen, handle = _packed_during_calls(engine)
    try:
        engine.generate(
            [[1, 60, 61]], SamplingParams(max_new_tokens=PACK_MIN_NEW_TOKENS - 1, temperature=0.0)
        )
    finally:
        handle.remove()
    assert seen and not any(seen)


def test_weights_offered_mid_call_are_packed_again(small_model, tokenizer):
    """New weights taken at a decode step: the packed engine goes on with them, as the plain one does (a packed
    copy of the old weights would give other log-probs from the switch on)."""
    new = copy.deepcopy(small_model)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.5)
    prompts = [[1, 60, 61, 62], [1, 63, 64]]
    params = SamplingParams(max_new_tokens=PACK_MIN_NEW_TOKENS + 4, temperature=0.0, ignore_eos=True)
    runs = {}
    for pack in (False, True):
        engine = TorchEngine(copy.deepcopy(small_model), tokenizer, pack_weights=pack)
        calls = []

        def offer(module, args, output, engine=engine, calls=calls):
            calls.append(1)
            if len(calls) == 4:  # the prefill and three decode steps
                engine.offer_weights(new.state_dict(), 1)

        handle = engine.model.register_forward_hook(offer)
        try:
            runs[pack] = engine.generate(prompts, params)
        finally:
            handle.remove()
        assert engine.version == 1
    for plain, packed in zip(runs[False], runs[True], strict=True):
        assert packed.token_versions == plain.token_versions and 1 in plain.token_versions
        assert packed.token_ids == plain.token_ids
        assert packed.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
