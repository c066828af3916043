"""training.mixed_precision=bf16: float32 master weights that the optimizer steps, forwards and backwards in
bfloat16, gradients accumulated and reduced in float32; the local casts (training.precision.cast_in_forward) and
FSDP2's MixedPrecisionPolicy give the same gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopline.bench.sync import run_world
from loopline.config import OptimConfig, TinyModelConfig
from loopline.data.batches import TokenBatch, collate, split_rows
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.training.policy import PolicyTrainer, response_logprobs
from loopline.training.precision import cast_in_forward

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _model() -> torch.nn.Module:
    return build_tiny_model(SMALL, build_byte_tokenizer(), seed=0)


def _batch() -> TokenBatch:
    """4 rows, prompts of 2-6 tokens, responses of 1-7 (left-padded, as the trainer sees them)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (3, 6, 2, 5)]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (7, 1, 4, 6)]
    return collate(prompts, responses, pad_id=0)


def _grads(model: torch.nn.Module, batches: list[TokenBatch]) -> dict[str, torch.Tensor]:
    """Gradients of the rows' summed response log-probs, one backward per batch (accumulated)."""
    for batch in batches:
        logp, _ = response_logprobs(model, batch, share_prompts=False)
        (logp * batch.response_mask).sum().backward()
    from torch.distributed.tensor import DTensor

    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in model.named_parameters()
    }


@pytest.mark.unit
def test_forward_runs_on_bf16_copies_and_gradients_arrive_in_fp32() -> None:
    """The casts compute exactly what a model holding bf16 parameters (buffers untouched, as FSDP2's policy does)
    computes; each gradient is that model's bf16 gradient, as float32, on the float32 parameter."""
    mixed = cast_in_forward(_model(), "bf16")
    low = _model()
    for p in low.parameters():
        p.data = p.data.to(torch.bfloat16)
    ids = _batch().input_ids
    out, want = mixed(input_ids=ids).logits, low(input_ids=ids).logits
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want)
    out.float().sum().backward()
    want.float().sum().backward()
    for (name, p), q in zip(mixed.named_parameters(), low.parameters()):
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, q.grad.float()), name
    # outside a forward the model holds its float32 Parameters, under their own names
    assert {type(p) for p in mixed.parameters()} == {torch.nn.Parameter}
    assert mixed.lm_head.weight is mixed.model.embed_tokens.weight  # still tied


@pytest.mark.unit
def test_the_optimizer_steps_fp32_masters_with_fp32_moments() -> None:
    model = cast_in_forward(_model(), "bf16")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-3, warmup_steps=0), total_steps=10)
    trainer.sft_step(_batch(), micro_batch_size=2)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        state = trainer.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32, name
        # an update of lr ~1e-3 on weights of ~1e-2 is below bf16's resolution there: only fp32 masters keep it
        assert not torch.equal(p.detach(), before[name]), name
    moved = model.model.layers[0].mlp.up_proj.weight.detach() - before["model.layers.0.mlp.up_proj.weight"]
    assert moved.abs().max() < 2e-3  # (lr-sized steps, not bf16-rounding-sized)
    assert not torch.equal(moved.to(torch.bfloat16).float(), moved)  # steps finer than bf16 can hold


@pytest.mark.unit
def test_a_bf16_step_is_close_to_the_fp32_step() -> None:
    """The gradient of a bf16 step against the fp32 one, tensor by tensor in norm. bf16 keeps 8 significant bits
    (unit roundoff 2^-9 ~ 2e-3); the forward and backward of 2 layers and a softmax compound it over a few dozen
    roundings of partial results, so the relative error of a whole tensor's gradient stays at the percent level:
    5e-2 allows that and is far below what a wrong cast (a gradient lost, or counted twice) would give (>= 1)."""
    batch = _batch()
    full = _grads(_model(), [batch])
    mixed = _grads(cast_in_forward(_model(), "bf16"), [batch])
    for name, g in full.items():
        err = float((mixed[name] - g).norm() / g.norm())
        assert err < 5e-2, (name, err)
    flat = torch.cat([g.flatten() for g in full.values()])
    flat_mixed = torch.cat([g.flatten() for g in mixed.values()])
    assert float(torch.nn.functional.cosine_similarity(flat, flat_mixed, dim=0)) > 0.999


def _rank_main(rank: int, world: int, batch: TokenBatch, out: str) -> None:
    """One FSDP2 rank under MixedPrecisionPolicy(bf16, fp32 reduce): the gradient of its half of the rows."""
    from loopline.training.parallel import shard_model, trainer_mesh

    mine = split_rows(batch, len(batch) // world)[rank]
    grads = _grads(shard_model(_model(), trainer_mesh(world), "bf16"), [mine])
    if rank == 0:
        torch.save(grads, Path(out) / "grads.pt")


@pytest.mark.gloo
def test_two_fsdp_ranks_under_the_policy_give_the_local_mixed_precision_gradients(tmp_path: Path) -> None:
    """2 FSDP2 ranks, each half the rows, against one process running both halves as micro-batches: each side
    computes each half's gradient in bf16 and sums the two halves in fp32 (reduce-scatter / accumulation), so the
    gradients agree bitwise (a sum of two terms does not depend on its order)."""
    batch = _batch()
    run_world(_rank_main, 2, args=(batch, str(tmp_path)), timeout_s=300)
    sharded = torch.load(tmp_path / "grads.pt")
    local = _grads(cast_in_forward(_model(), "bf16"), split_rows(batch, 2))
    full = _grads(_model(), [batch])
    for name in local:
        torch.testing.assert_close(sharded[name], local[name], rtol=0, atol=0, msg=name)
        assert not torch.equal(local[name], full[name]), name  # bf16 compute, not fp32
