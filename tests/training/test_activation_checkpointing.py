"""training.activation_checkpointing: decoder layers recomputed in backward give the gradients of the plain
path (float64, within 1e-6) on one process, on 2 FSDP2 gloo ranks, on 2 TP ranks and on 2 pipeline stages, while
backward keeps fewer bytes; the shared-prompt forwards (a GRPO group's prompt forwarded once) are recomputed too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopline.bench.sync import run_world
from loopline.config import TinyModelConfig
from loopline.data.batches import TokenBatch, collate, split_rows
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.training.parallel import apply_activation_checkpointing
from loopline.training.policy import response_logprobs

SMALL = TinyModelConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64)


def _model(mode: str) -> torch.nn.Module:
    model = build_tiny_model(SMALL, build_byte_tokenizer(), seed=0).to(torch.float64)
    return apply_activation_checkpointing(model, mode)


def _batch() -> TokenBatch:
    """4 rows, prompts of 2-6 tokens, responses of 1-7 (left-padded, as the trainer sees them)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (3, 6, 2, 5)]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (7, 1, 4, 6)]
    return collate(prompts, responses, pad_id=0)


def _grads(model: torch.nn.Module, batch: TokenBatch, share_prompts: bool = False) -> dict[str, torch.Tensor]:
    """Gradients of the rows' summed response log-probs (by default each row its own full forward)."""
    logp, _ = response_logprobs(model, batch, share_prompts=share_prompts)
    (logp * batch.response_mask).sum().backward()
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
    return out


def _saved_bytes(model: torch.nn.Module, batch: TokenBatch, share_prompts: bool = False) -> int:
    """Bytes of the tensors the forward saves for backward (what activation checkpointing shrinks)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = response_logprobs(model, batch, share_prompts=share_prompts)
    return total


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_layers_give_the_plain_gradients_and_keep_less(mode: str) -> None:
    batch = _batch()
    plain, checkpointed = _grads(_model("none"), batch), _grads(_model(mode), batch)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-6, msg=name)
    assert max(float(g.abs().max()) for g in plain.values()) > 1e-3  # gradients that say something
    saved = {m: _saved_bytes(_model(m), batch) for m in ("none", "selective", "full")}
    assert saved["full"] < saved["selective"] < saved["none"], saved


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_shared_prompt_forwards_are_recomputed_with_the_same_gradients(mode: str) -> None:
    # the prompt's cache is filled once and the responses read it: a recomputed layer must neither fill it again
    # nor lengthen it, and every layer is recomputed (backward keeps less), not run plainly beside a cache
    from tests.training.test_prefix import _grouped_batch

    batch = _grouped_batch()
    plain, checkpointed = _grads(_model("none"), batch, True), _grads(_model(mode), batch, True)
    plain_saved, saved = _saved_bytes(_model("none"), batch, True), _saved_bytes(_model(mode), batch, True)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-6, msg=name)
    assert max(float(g.abs().max()) for g in plain.values()) > 1e-3
    assert saved < plain_saved * (0.3 if mode == "full" else 0.7), (saved, plain_saved)


def _rank_main(rank: int, world: int, batch: TokenBatch, out: str) -> None:
    """One FSDP2 rank, checkpointed layers: the gradient of its half of the rows (FSDP2 sums over ranks)."""
    from loopline.training.parallel import shard_model, trainer_mesh

    mesh = trainer_mesh(world)
    mine = split_rows(batch, len(batch) // world)[rank]
    grads = _grads(shard_model(_model("full"), mesh), mine)
    if rank == 0:
        torch.save(grads, Path(out) / "grads.pt")


@pytest.mark.gloo
def test_two_fsdp_ranks_with_checkpointed_layers_give_the_plain_gradients(tmp_path: Path) -> None:
    batch = _batch()
    run_world(_rank_main, 2, args=(batch, str(tmp_path)), timeout_s=90)
    sharded = torch.load(tmp_path / "grads.pt")
    plain = _grads(_model("none"), batch)
    for name in plain:
        torch.testing.assert_close(sharded[name], plain[name], rtol=0, atol=1e-6, msg=name)


def _tp_rank_main(rank: int, world: int, batch: TokenBatch, out: str) -> None:
    """One of 2 TP ranks (the same rows on both), checkpointed layers: the whole gradient."""
    from loopline.training.parallel import dp_tp_mesh, parallelize

    model = parallelize(_model("full"), dp_tp_mesh(world, world))
    grads = _grads(model, batch)
    if rank == 0:
        torch.save(grads, Path(out) / "grads.pt")


@pytest.mark.gloo
def test_two_tp_ranks_with_checkpointed_layers_give_the_plain_gradients(tmp_path: Path) -> None:
    batch = _batch()
    run_world(_tp_rank_main, 2, args=(batch, str(tmp_path)), timeout_s=90)
    sharded = torch.load(tmp_path / "grads.pt")
    plain = _grads(_model("none"), batch)
    for name in plain:
        torch.testing.assert_close(sharded[name], plain[name], rtol=0, atol=1e-6, msg=name)


def _pp_rank_main(rank: int, world: int, batch: TokenBatch, out: str) -> None:
    """One of 2 pipeline stages, checkpointed layers, one SFT step: the stage's whole gradients."""
    from loopline.config import OptimConfig
    from loopline.training.pipeline import PipelineTrainer, parallelize_stages, pp_mesh, split_model

    mesh = pp_mesh(world, world, 1)
    stages = parallelize_stages(split_model(_model("full"), mesh.get_coordinate()[0], world, 1), mesh)
    trainer = PipelineTrainer(stages, mesh, OptimConfig(grad_clip=1e9), 10, "gpipe", None, 2)
    grads: list = []
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.append(_stage_grads(stages)))
    trainer.sft_step(batch, 2)
    torch.save(grads[0], Path(out) / f"grads{rank}.pt")


def _stage_grads(stages: list) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for stage in stages
        for name, p in stage.named_parameters()
    }


@pytest.mark.gloo
def test_two_pipeline_stages_with_checkpointed_layers_give_the_plain_gradients(tmp_path: Path) -> None:
    from loopline.config import OptimConfig
    from loopline.training.policy import PolicyTrainer

    batch = _batch()
    run_world(_pp_rank_main, 2, args=(batch, str(tmp_path)), timeout_s=90)
    first, last = torch.load(tmp_path / "grads0.pt"), torch.load(tmp_path / "grads1.pt")
    # the tied embedding is two copies, on the first and last stage, their gradients summed before the step
    torch.testing.assert_close(last.pop("lm_head.weight"), first["model.embed_tokens.weight"], rtol=0, atol=0)
    piped = {**first, **last}
    model = _model("none")
    trainer = PolicyTrainer(model, OptimConfig(grad_clip=1e9), total_steps=10, micro_batch_size=2)
    plain: list = []
    trainer.optimizer.register_step_pre_hook(lambda *_: plain.append(_stage_grads([model])))
    trainer.sft_step(batch, 2)
    assert piped.keys() == plain[0].keys()
    for name, grad in piped.items():
        torch.testing.assert_close(grad, plain[0][name], rtol=0, atol=1e-6, msg=name)
