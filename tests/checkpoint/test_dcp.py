"""DCP checkpoints across ranks: two FSDP2 gloo ranks (real spawned processes) each write their own shards,
and one process without a process group loads them (resharding 2 -> 1) exactly: weights, AdamW moments
and step counts, LR schedule. An asynchronous save writes the state as it was at the call, although the
ranks train on at once. Rank 0's Hugging Face weights equal the gathered model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loopline.bench.sync import run_world
from loopline.checkpoint.dcp import ShardWriter, load_shards, read_full_state, shard_state
from loopline.config import OptimConfig, TinyModelConfig
from loopline.data.batches import TokenBatch, collate, split_rows
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.training.parallel import full_optimizer_state
from loopline.training.policy import PolicyTrainer

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", grad_clip=1.0)
RANKS = 2


def _model() -> torch.nn.Module:
    return build_tiny_model(SMALL, build_byte_tokenizer(), seed=0)


def _batch(seed: int) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (4, 2, 5, 3)]
    return collate(prompts, responses, pad_id=0)


def _rank_main(rank: int, world: int, out: str) -> None:
    """Two SFT steps on FSDP2 ranks; a blocking save, an async save overtaken by a third step, references."""
    import torch.distributed as dist

    from loopline.training.parallel import full_model_state, shard_model, trainer_mesh

    mesh = trainer_mesh(world)
    model = shard_model(_model(), mesh)
    trainer = PolicyTrainer(model, OPTIM, total_steps=10, group=mesh.get_group())
    # the checkpoint I/O group, as ActorWorker makes it
    group = dist.new_group(list(range(world)), backend="gloo", use_local_synchronization=True)
    for seed in (1, 2):
        trainer.sft_step(split_rows(_batch(seed), 2)[rank], micro_batch_size=1)
    reference = copy.deepcopy(
        {
            "model": full_model_state(model),
            "optim": full_optimizer_state(model, trainer.optimizer),
            "scheduler": trainer.scheduler.state_dict(),
        }
    )  # whole tensors on rank 0 (collectives: every rank takes part); copied, as AdamW's step counts are live
    writer = ShardWriter()
    weights = full_model_state(model)
    hf = (model, weights, str(Path(out) / "hf")) if rank == 0 else None
    writer.save(Path(out) / "blocking", shard_state(model, trainer), group=group, hf=hf)
    writer.save(Path(out) / "async", shard_state(model, trainer), group=group, blocking=False)
    trainer.sft_step(split_rows(_batch(3), 2)[rank], micro_batch_size=1)  # while the async write runs
    writer.wait(60)
    after = full_model_state(model)
    if rank == 0:
        torch.save({"before": reference, "after": after}, Path(out) / "reference.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp")
    run_world(_rank_main, RANKS, args=(str(out),), timeout_s=120)
    return out


def _assert_equal_trees(got: object, want: object, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            _assert_equal_trees(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


@pytest.mark.parametrize("name", ["blocking", "async"])
def test_two_rank_shards_load_into_one_process_exactly(saved: Path, name: str) -> None:
    reference = torch.load(saved / "reference.pt", weights_only=False)["before"]
    assert sorted(p.name for p in (saved / name).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    model = _model()
    trainer = PolicyTrainer(model, OPTIM, total_steps=10)
    load_shards(saved / name, model, trainer)  # no process group: one rank reads both ranks' shards
    _assert_equal_trees(dict(model.state_dict()), reference["model"], "model")
    _assert_equal_trees(full_optimizer_state(model, trainer.optimizer), reference["optim"], "optim")
    assert trainer.scheduler.state_dict() == reference["scheduler"]
    # the async save holds the state of its call, not the step the ranks took while it was written
    after = torch.load(saved / "reference.pt", weights_only=False)["after"]
    assert any(not torch.equal(after[k], reference["model"][k]) for k in after)


def test_the_loaded_trainer_continues_like_the_two_ranks(saved: Path) -> None:
    model = _model()
    trainer = PolicyTrainer(model, OPTIM, total_steps=10)
    load_shards(saved / "blocking", model, trainer)
    trainer.sft_step(_batch(3), micro_batch_size=1)  # the third step, on one rank: AdamW moments restored
    after = torch.load(saved / "reference.pt", weights_only=False)["after"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, after[name], rtol=0, atol=1e-6, msg=name)


def test_rank_zero_hf_weights_and_full_read(saved: Path) -> None:
    reference = torch.load(saved / "reference.pt", weights_only=False)["before"]
    hf = load_file(saved / "hf" / "model.safetensors")
    assert "lm_head.weight" not in hf  # tied to the embeddings: saved once, as transformers does
    for name, tensor in hf.items():
        assert torch.equal(tensor, reference["model"][name]), name
    full = read_full_state(saved / "blocking")
    assert full["scheduler"] == reference["scheduler"]
    for name, tensor in reference["model"].items():
        assert torch.equal(full["model"][name], tensor), name
