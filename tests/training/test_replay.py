"""Rollout routing replay (training.replay, grpo.routing_replay) on the scaled-down MoE presets: replaying a model's
own routes changes nothing; replaying others makes every router use exactly them, with weights from the trainer's
own probabilities, in the padded, shared-prompt and packed forwards alike; route_mismatch counts the training
forwards' disagreements; the engine's recorded routes, laid out by sample_routes, are what replay imposes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from loopline.cli import main
from loopline.config import ConfigError, load_config
from loopline.data.batches import collate
from loopline.models.moe import router_hooks
from loopline.rollout.engine import SamplingParams, TorchEngine
from loopline.training.packing import pack
from loopline.training.policy import response_logprobs
from loopline.training.replay import RouteReplay, sample_routes
from tests.moe import tiny_moe

pytestmark = pytest.mark.unit

PRESETS = ["qwen3-moe-tiny", "mixtral-tiny"]


def _batch(seed: int = 0):
    """Four sequences (two prompts of different lengths, two samples each), padded as collate pads them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[1, 5, 6, 7], [1, 9, 8], [1, 5, 6, 7], [1, 9, 8]]
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 2, 4, 6)]
    return collate(prompts, responses, pad_id=0)


def _used_routes(model, fn):
    """fn()'s result and the experts every router call used, (N, L, k) per call of the model, in call order."""
    calls: list[dict[int, torch.Tensor]] = [{}]

    def record(position: int, logits: torch.Tensor, experts: torch.Tensor) -> None:
        if position in calls[-1]:
            calls.append({})
        calls[-1][position] = experts

    with router_hooks(model, record):  # registered after RouteReplay's hooks: sees what they return
        out = fn()
    return out, [torch.stack([c[p] for p in sorted(c)], dim=1) for c in calls]


def _own_routes(model, batch) -> torch.Tensor:
    """(B, W, L, k): the experts the model itself chooses for every token of the batch's padded rows."""
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        _, (routes,) = _used_routes(
            model,
            lambda: model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions
            ),
        )
    return routes.view(*batch.input_ids.shape, *routes.shape[1:]).to(torch.int16)


def _other_routes(model, batch, seed: int = 1) -> torch.Tensor:
    """Routes the model would not choose: k distinct random experts per token and layer, -1 on padding."""
    own = _own_routes(model, batch)
    experts = (
        model.config.num_experts if hasattr(model.config, "num_experts") else model.config.num_local_experts
    )
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand((*own.shape[:-1], experts), generator=g)
    routes = scores.topk(own.shape[-1], dim=-1).indices.to(torch.int16)
    p = batch.prompt_len
    routes[2:, :p] = routes[:2, :p]  # rows 2, 3 repeat rows 0, 1's prompts: the engine routes a prompt once
    return torch.where(batch.attention_mask.bool()[..., None, None], routes, -1)


@pytest.mark.parametrize("preset", PRESETS)
def test_replaying_the_models_own_routes_changes_nothing(preset):
    model, batch = tiny_moe(preset), _batch()
    plain, _ = response_logprobs(model, batch, share_prompts=False)
    replay = RouteReplay(model, replay=True)
    routes = _own_routes(model, batch)
    own, _ = response_logprobs(model, replace(batch, routes=routes), share_prompts=False)
    assert torch.equal(own, plain)
    assert replay.metrics() == {"route_mismatch": 0.0}  # a training forward (grad on, train mode): counted


@pytest.mark.parametrize("preset", PRESETS)
def test_replay_makes_every_router_use_the_given_experts_in_every_layout(preset):
    model, batch = tiny_moe(preset), _batch()
    plain, _ = response_logprobs(model, batch, share_prompts=False)
    routes = _other_routes(model, batch)
    batch.routes = routes
    RouteReplay(model, replay=True)
    padded, (used,) = _used_routes(model, lambda: response_logprobs(model, batch, share_prompts=False)[0])
    real = batch.attention_mask.bool().flatten()
    want = routes.flatten(0, 1)[real].long()
    assert torch.equal(used[real], want)  # exactly the given experts, in their order
    assert not torch.allclose(padded, plain, atol=1e-4)  # and they matter
    shared, _ = _used_routes(model, lambda: response_logprobs(model, batch, share_prompts=True)[0])
    packed, calls = _used_routes(model, lambda: response_logprobs(model, batch, packed=True)[0])
    used_packed = calls[-1]  # (the first packed forward of a model checks it first)
    # the same experts in the three layouts give the same log-probs (up to the order of float sums)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(shared[mask], padded[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[mask], padded[mask], rtol=1e-5, atol=1e-5)
    slot = pack(batch.input_ids, batch.attention_mask).slot  # where each token sits in the packed rows
    assert torch.equal(used_packed[slot.flatten()[real]], want)  # the packed forward's real tokens: the same


@pytest.mark.parametrize("preset", PRESETS)
def test_route_mismatch_counts_training_forwards_only_and_replay_off_routes_on_its_own(preset):
    model, batch = tiny_moe(preset), _batch()
    plain, _ = response_logprobs(model, batch, share_prompts=False)
    routes, own = _other_routes(model, batch), _own_routes(model, batch)
    half = routes.clone()
    half[::2] = own[::2]  # rows 0 and 2 keep the model's routes: only rows 1 and 3 differ
    half = torch.where(batch.attention_mask.bool()[..., None, None], half, -1)
    batch.routes = half
    replay = RouteReplay(model, replay=False)
    with torch.no_grad():
        response_logprobs(model, batch, share_prompts=False)
    assert replay.metrics() == {}  # no training forward had routes
    out, _ = response_logprobs(model, batch, share_prompts=False)
    assert torch.equal(out, plain)  # off: the model routes on its own
    known = half[..., 0, 0] >= 0  # (B, W)
    differ = (half.sort(-1).values != own.sort(-1).values).any(-1) & known[..., None]  # (B, W, L)
    expected = float(differ.sum()) / (float(known.sum()) * half.shape[2])
    assert 0 < expected < 1
    assert replay.metrics() == {"route_mismatch": pytest.approx(expected)}


def test_sample_routes_lays_routes_out_as_collate_lays_out_tokens():
    a = torch.arange(4 * 2 * 1, dtype=torch.int16).view(4, 2, 1)  # prompt 3 + 2 tokens: 4 positions
    b = torch.arange(100, 100 + 2 * 2 * 1, dtype=torch.int16).view(2, 2, 1)  # prompt 2 + 1 token: 2 positions
    out = sample_routes([a, b], [3, 2], prompt_width=3, width=6)
    assert out.shape == (2, 6, 2, 1)
    assert torch.equal(out[0, :4], a) and (out[0, 4:] == -1).all()
    assert (out[1, 0] == -1).all() and torch.equal(out[1, 1:3], b) and (out[1, 3:] == -1).all()
    assert sample_routes([a, None], [3, 2], 3, 6) is None


def test_replay_imposes_the_engines_recorded_routes(tokenizer):
    engine_model, model = tiny_moe(seed=0), tiny_moe(seed=1)  # different weights: their routers disagree
    engine = TorchEngine(engine_model, tokenizer, seed=0, record_routes=True)
    prompts = [tokenizer(t)["input_ids"] for t in ("7+5=", "12+30=")]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0), n=2)
    rows = [prompts[c.prompt_index] for c in completions]
    batch = collate(rows, [c.token_ids for c in completions], tokenizer.pad_token_id)
    batch.routes = sample_routes([c.routes for c in completions], [len(p) for p in rows], batch.prompt_len,
                                 batch.input_ids.shape[1])  # fmt: skip
    replay = RouteReplay(model, replay=True)
    _, (used,) = _used_routes(model, lambda: response_logprobs(model, batch, share_prompts=False))
    known = (batch.routes[..., 0, 0] >= 0).flatten()
    assert known.sum() == sum(len(p) + len(c.token_ids) - 1 for p, c in zip(rows, completions))
    assert torch.equal(used[known], batch.routes.flatten(0, 1)[known].long())
    assert replay.metrics()["route_mismatch"] > 0.5  # another model's routers: mostly other experts


def test_a_dense_model_has_no_routes_to_replay(small_model):
    with pytest.raises(ValueError, match="not a mixture of experts"):
        RouteReplay(small_model, replay=True)


@pytest.mark.parametrize(
    "override,named",
    [
        ("rollout.engine=vllm", "rollout.engine=vllm"),
        ("training.activation_checkpointing=full", "training.activation_checkpointing=full"),
        ("env.max_turns=2", "multi-turn"),
    ],
)
def test_replay_where_the_forwards_cannot_take_routes_is_refused_naming_the_setting(override, named):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["grpo.routing_replay=true", override])
    assert "grpo.routing_replay=true is not built with" in str(err.value) and named in str(err.value)
    load_config(overrides=["grpo.routing_replay=false", override])  # off: nothing to refuse


def test_replay_on_a_dense_model_exits_2_in_one_line(tmp_path, capsys):
    assert main(["train", f"out_dir={tmp_path / 'run'}", "grpo.routing_replay=true"]) == 2
    err = capsys.readouterr().err
    assert "grpo.routing_replay=true: the built-in model is not a mixture of experts" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_later_trainer_on_the_same_model_replaces_the_hooks():
    model, batch = tiny_moe(), _batch()
    batch.routes = _other_routes(model, batch)
    first, second = RouteReplay(model, replay=True), RouteReplay(model, replay=False)
    plain_model = tiny_moe()
    out, _ = response_logprobs(model, batch, share_prompts=False)
    assert torch.equal(out, response_logprobs(plain_model, batch, share_prompts=False)[0])  # replay off now
    assert first.metrics() == {} and second.metrics()["route_mismatch"] > 0.5  # counted once, by the second
