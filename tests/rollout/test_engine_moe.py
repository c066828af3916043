"""TorchEngine on mixture-of-experts models (the scaled-down Qwen3-MoE and Mixtral presets): greedy generation
through its KV cache equals Hugging Face generate, and the routes it records (record_routes) are the experts a
trainer's forward of the same tokens chooses, position by position, in the same dtype."""

from __future__ import annotations

import pytest
import torch

from loopline.models.moe import router_hooks
from loopline.rollout.engine import SamplingParams, TorchEngine
from tests.moe import tiny_moe

pytestmark = pytest.mark.unit

PROMPTS_TEXT = ["7+5=", "12+30=", "4+91=", "3+3=", "60+9="]  # 5 to 7 tokens with <bos>: padding varies


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_greedy_matches_hf_generate(tokenizer, preset):
    model = tiny_moe(preset).eval()
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS_TEXT]
    got = TorchEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    enc = tokenizer(PROMPTS_TEXT, padding=True, return_tensors="pt")
    out = model.generate(**enc, do_sample=False, max_new_tokens=8, pad_token_id=0, eos_token_id=2)
    expected = [
        row[: row.index(2) + 1] if 2 in row else row for row in out[:, enc["input_ids"].shape[1] :].tolist()
    ]
    assert [c.token_ids for c in got] == expected


def _trainer_routes(model, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), L, k): the experts each router chooses at each position in one forward of `tokens`."""
    chosen: dict[int, torch.Tensor] = {}

    def record(position: int, logits: torch.Tensor, experts: torch.Tensor) -> None:
        chosen[position] = experts

    with router_hooks(model, record), torch.no_grad():
        model(input_ids=torch.tensor([tokens]), use_cache=False)
    return torch.stack([chosen[p] for p in sorted(chosen)], dim=1)


@pytest.mark.parametrize("max_rows", [0, 4])  # all rows at once; rows leaving and prompts joining mid-call
def test_recorded_routes_are_the_trainers(tokenizer, max_rows):
    model = tiny_moe()
    with torch.no_grad():
        model.lm_head.weight[2] *= 40  # <eos> likely from some positions: samples end at different steps
    engine = TorchEngine(model, tokenizer, seed=0, max_rows=max_rows, record_routes=True)
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS_TEXT]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0), n=2)
    assert (
        len({len(c.token_ids) for c in completions}) > 1
    )  # lengths differ: rows finished at different steps
    for c in completions:
        tokens = prompts[c.prompt_index] + c.token_ids
        assert c.routes is not None and c.routes.dtype == torch.int16
        assert c.routes.shape == (len(tokens) - 1, 2, 8)  # every position but the last, 2 layers, top-8
        expected = _trainer_routes(model, tokens)[:-1]
        # the same experts at every position and layer (their order within the top-k is not part of a route)
        assert torch.equal(c.routes.sort(-1).values, expected.sort(-1).values.to(torch.int16))


def test_routes_are_recorded_only_when_asked_and_only_for_moe(tokenizer, small_model):
    prompts = [tokenizer("1+2=")["input_ids"]]
    plain = TorchEngine(tiny_moe(), tokenizer).generate(prompts, SamplingParams(max_new_tokens=3))
    assert plain[0].routes is None
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has no routers to record"):
        TorchEngine(small_model, tokenizer, record_routes=True)
