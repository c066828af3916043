"""FSDP2 over 2 gloo ranks makes the same update as one rank on the same global batch.

The global batch has uneven response lengths (one row empty), so token-mean weighting only comes out
right with global denominators; gradients are compared (AdamW would hide a wrong overall scale), and so
are the weights after two policy_step updates (per loss_agg) and one sft_step (by tests/numerics.py's rule:
AdamW amplifies the float noise of near-zero gradients), and the reported stats.
One rank runs in this process on the plain model; the two ranks are real spawned processes.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from loopline.bench.sync import run_world
from loopline.config import GRPOConfig, OptimConfig, SamplingConfig, TinyModelConfig
from loopline.data.batches import RolloutBatch, collate, split_rows
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs
from tests.numerics import assert_adam_updates_close

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
LOSS_AGGS = ("token_mean", "seq_mean", "fixed_length")
MAX_NEW = 7
RANKS = 2
GRPO_STEPS = 2
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0)


def _grpo_cfg(loss_agg: str, micro: int) -> GRPOConfig:
    return GRPOConfig(
        loss_agg=loss_agg,
        micro_batch_size=micro,
        kl_coef=0.05,
        entropy_coef=0.01,
        sampling=SamplingConfig(max_new_tokens=MAX_NEW),
    )


def _model() -> torch.nn.Module:
    return build_tiny_model(SMALL, build_byte_tokenizer(), seed=0)


def _global_batch() -> RolloutBatch:
    """8 rows, prompts of 2-6 tokens (the first four in groups of two, each forwarded once), responses of 0-7
    (the ranks get 24 and 8 response tokens)."""
    g = torch.Generator().manual_seed(3)
    p_lens, r_lens = [3, 6, 2, 4, 5, 2, 3, 6], [7, 6, 4, 7, 1, 0, 2, 5]
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in p_lens]
    # rows 0-3 (rank 0) in groups of two, rows 4-7 (rank 1) distinct: the ranks' slices differ in what they
    # share, and must still make the same forwards (FSDP2 gathers in each)
    prompts = [prompts[i - i % 2] if i < 4 else prompts[i] for i in range(8)]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in r_lens]
    tokens = collate(prompts, responses, pad_id=0)
    with torch.no_grad():
        current, _ = response_logprobs(_model(), tokens)
    # behaviour and reference log-probs off by up to +-0.4 nats: some ratios clip
    old = current + 0.8 * (torch.rand(current.shape, generator=g) - 0.5)
    ref = current + 0.8 * (torch.rand(current.shape, generator=g) - 0.5)
    return RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=old, ref_logprobs=ref, advantages=torch.randn(8, generator=g), rewards=torch.zeros(8),
    )  # fmt: skip


def _run(trainer: PolicyTrainer, batch: RolloutBatch, loss_agg: str | None, micro: int, grads: list) -> dict:
    """GRPO_STEPS policy_steps under `loss_agg` (or one sft_step if None); stats per step."""
    hook = trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(_full_grads(trainer.model)))
    if loss_agg is None:
        stats = [trainer.sft_step(batch, micro)]
    else:
        cfg = _grpo_cfg(loss_agg, micro)
        trainer.loss, trainer.micro_batch_size = grpo_loss(cfg), micro  # the RL phase's objective, set once
        stats = [trainer.policy_step(batch, cfg.kl_coef) for _ in range(GRPO_STEPS)]
    hook.remove()
    return {
        "loss": [s.loss for s in stats],
        "grad_norm": [s.grad_norm for s in stats],
        "extra": [s.extra for s in stats],
    }


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole gradients by name (a collective on DTensor gradients: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _cases() -> list[str | None]:
    return [*LOSS_AGGS, None, PACKED, CHUNKED]  # None = sft_step


PACKED = "token_mean_packed"  # the sharded ranks on packed forwards (model.packing), one rank padded
# the sharded ranks with the head's logits 4 tokens at a time (model.logits_chunk_tokens), one rank whole
CHUNKED = "token_mean_chunked"


def _rank_main(rank: int, world: int, batch: RolloutBatch, out: str) -> None:
    """One FSDP2 rank: its half of the batch, micro-batches of 3 rows; rank 0 saves the results."""
    from loopline.training.parallel import full_model_state, shard_model, trainer_mesh

    mesh = trainer_mesh(world)
    rows = len(batch) // world
    mine = split_rows(batch, rows)[rank]
    results = {}
    for case in _cases():
        model = shard_model(_model(), mesh)
        trainer = PolicyTrainer(
            model, OPTIM, total_steps=10, group=mesh.get_group(), packed=case == PACKED,
            chunk_tokens=4 if case == CHUNKED else 0,
        )  # fmt: skip
        grads: list = []
        stats = _run(trainer, mine, "token_mean" if case in (PACKED, CHUNKED) else case, micro=3, grads=grads)
        results[str(case)] = {"stats": stats, "grads": grads, "weights": full_model_state(model)}
    if rank == 0:
        torch.save(results, Path(out) / "ranks.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """(one rank in this process, two ranks in spawned processes), per case."""
    batch = _global_batch()
    out = tmp_path_factory.mktemp("fsdp")
    run_world(_rank_main, RANKS, args=(batch, str(out)), timeout_s=90)
    sharded = torch.load(out / "ranks.pt", weights_only=False)
    single = {}
    for case in _cases():
        model = _model()
        grads: list = []
        loss_agg = "token_mean" if case in (PACKED, CHUNKED) else case
        stats = _run(
            PolicyTrainer(model, OPTIM, total_steps=10), copy.deepcopy(batch), loss_agg, micro=3, grads=grads
        )
        single[str(case)] = {"stats": stats, "grads": grads, "weights": model.state_dict()}
    return single, sharded


@pytest.mark.parametrize("case", [*LOSS_AGGS, "sft", PACKED, CHUNKED])
def test_two_fsdp_ranks_update_like_one(results: tuple[dict, dict], case: str) -> None:
    single, sharded = (r["None" if case == "sft" else case] for r in results)
    # gradients of every step, whole (a wrong denominator or a factor of the world size shows there), and the
    # weights after the updates, by the rule for two reduction orders under AdamW (tests/numerics.py)
    w1, w2 = single["weights"], sharded["weights"]
    w0 = _model().state_dict()
    lrs = [OPTIM.lr] * len(single["grads"])
    assert_adam_updates_close(
        w0, w1, w2, lrs=lrs, grads_a=single["grads"], grads_b=sharded["grads"], betas=OPTIM.betas, msg=case
    )
    moved = max(float((w1[name] - w0[name]).abs().max()) for name in w1)
    assert moved > 1e-4  # the update did move the weights
    # and the reported statistics are the global ones
    s1, s2 = single["stats"], sharded["stats"]
    assert s2["loss"] == pytest.approx(s1["loss"], rel=1e-5, abs=1e-7)
    assert s2["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-5)
    assert all(math.isfinite(x) for x in s1["loss"])
    for e1, e2 in zip(s1["extra"], s2["extra"]):
        assert e1.keys() == e2.keys()
        for key in e1:
            assert e2[key] == pytest.approx(e1[key], rel=1e-5, abs=1e-7), key
