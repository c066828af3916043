"""The weight sync into an engine of another dtype (rollout.dtype=bfloat16 beside float32 master weights): the
plan moves the engine's dtype, the trainer casts as it packs (half the bytes on the wire), and the engine ends
holding exactly `master.to(bfloat16)`, on the in-process path (local backend) and the packed path (ray)."""

from __future__ import annotations

import copy

import pytest
import torch

from loopline.config import TinyModelConfig
from loopline.distributed.resharding import TrainerLayout
from loopline.distributed.weight_sync import (
    _pack,
    _unpack,
    copy_in_process,
    engine_tensors,
    engines_plan,
    local_shards,
)
from loopline.models.load import build_tiny_model, cast_parameters
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.runtime.engine_sync import plan_params, sync_plan

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A float32 trainer model after a change (so the engine's start tells nothing), and a bf16 engine copy."""
    trainer = build_tiny_model(SMALL, build_byte_tokenizer(), seed=0)
    engine = cast_parameters(copy.deepcopy(trainer), "bfloat16")
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # bits below bf16's resolution: rounding must be to nearest
    return trainer, engine


def _expected(trainer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in trainer.named_parameters()}


@pytest.mark.unit
def test_in_process_sync_into_a_bf16_engine_is_the_masters_rounded() -> None:
    trainer, engine = _models()
    layout = TrainerLayout(fsdp=1)
    plan = sync_plan(None, engine, layout, (0,))  # the engine plans with its own (bf16) parameters
    copy_in_process(plan, {0: local_shards(trainer)}, {layout.size: engine_tensors(engine)})
    got = dict(engine.named_parameters())
    for name, want in _expected(trainer).items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], want), name
    assert engine.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep theirs, as the trainer's


@pytest.mark.unit
def test_packed_sync_casts_on_the_trainer_side_and_sends_bf16_bytes() -> None:
    trainer, engine = _models()
    layout = TrainerLayout(fsdp=1)
    specs, rule = plan_params(trainer, 1, "bfloat16")  # what a trainer rank plans with (actor.join)
    plan = engines_plan(specs, layout, (0,), rule)
    mine = sync_plan(None, engine, layout, (0,))  # the engine's own plan: both sides move the same bytes
    assert plan.params == mine.params and plan.transfers_to(1) == mine.transfers_to(1)
    transfers = plan.transfers_from(0)
    wire = {s.name: s.dtype for s in plan.params}
    buf = _pack(transfers, local_shards(trainer), wire)
    fp32_bytes = sum(p.numel() * 4 for p in trainer.parameters())
    assert buf.numel() <= fp32_bytes // 2 + 16 * len(transfers)  # bf16 on the wire (plus alignment)
    _unpack(buf, transfers, engine_tensors(engine), wire)
    got = dict(engine.named_parameters())
    for name, want in _expected(trainer).items():
        assert torch.equal(got[name], want), name
