"""DCP checkpoints across ranks: two FSDP2 gloo ranks (real spawned processes) each write their own shards,
and one process without a process group loads them (resharding 2 -> 1) exactly: weights, AdamW moments
and step counts, LR schedule. An asynchronous save writes the state as it was at the call, although the
ranks train on at once. Rank 0's Hugging Face weights equal the gathered model. Two pipeline stages' shards
load into one rank, and the FSDP2 ranks' into two stages: each then takes the step the other run took.
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
from tests.numerics import assert_adam_updates_close

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
    before = copy.deepcopy(model.state_dict())
    trainer.sft_step(_batch(3), micro_batch_size=1)  # the third step, on one rank: AdamW moments restored
    after = torch.load(saved / "reference.pt", weights_only=False)["after"]
    _assert_third_step_alike(before, model.state_dict(), after)


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


# ---------------------------------------------------------------------------------------------------------
# Pipelined ranks (training.pipeline, pp=2): the same names, so checkpoints cross pp in both directions
# ---------------------------------------------------------------------------------------------------------


def _pp_rank_main(rank: int, world: int, out: str, fsdp_dir: str) -> None:
    """Two SFT steps on two pipeline stages, saved, then a third; and the 2 FSDP2 ranks' checkpoint (written by
    `saved`) loaded into fresh stages, which take that run's third step."""
    import torch.distributed as dist

    from loopline.training.pipeline import (
        PipelineTrainer,
        StageParts,
        full_pipeline_state,
        parallelize_stages,
        pp_mesh,
        split_model,
    )

    mesh = pp_mesh(world, pp=world)
    group = dist.new_group(list(range(world)), backend="gloo", use_local_synchronization=True)

    def trainer() -> tuple[PipelineTrainer, StageParts]:
        stages = parallelize_stages(split_model(_model(), mesh.get_coordinate()[0], world), mesh)
        return PipelineTrainer(stages, mesh, OPTIM, 10, "1f1b", micro_batch_size=1), StageParts(stages)

    piped, parts = trainer()
    for seed in (1, 2):
        piped.sft_step(_batch(seed), micro_batch_size=1)  # every stage takes all rows (dp = 1)
    ShardWriter().save(Path(out) / "pp", shard_state(parts, piped), group=group)
    piped.sft_step(_batch(3), micro_batch_size=1)
    after = full_pipeline_state(piped.stages, mesh)
    resumed, resumed_parts = trainer()
    load_shards(fsdp_dir, resumed_parts, resumed, group=group, optim_aliases=resumed_parts.optim_aliases)
    resumed.sft_step(_batch(3), micro_batch_size=1)
    from_fsdp = full_pipeline_state(resumed.stages, mesh)
    if rank == 0:
        torch.save({"after": after, "from_fsdp": from_fsdp}, Path(out) / "pp.pt")


@pytest.fixture(scope="module")
def pipelined(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp_pp")
    run_world(_pp_rank_main, RANKS, args=(str(out), str(saved / "blocking")), timeout_s=120)
    return out


def test_a_pipelined_checkpoint_loads_into_one_rank_and_an_fsdp_one_into_the_stages(
    saved: Path, pipelined: Path
) -> None:
    ran = torch.load(pipelined / "pp.pt", weights_only=False)
    model = _model()
    trainer = PolicyTrainer(model, OPTIM, total_steps=10)
    load_shards(pipelined / "pp", model, trainer)  # the stages' shards: each stage wrote its own names
    assert trainer.scheduler.state_dict()["last_epoch"] == 2
    before = copy.deepcopy(model.state_dict())
    trainer.sft_step(_batch(3), micro_batch_size=1)  # AdamW moments restored: the pipeline's third step
    _assert_third_step_alike(before, model.state_dict(), ran["after"])
    reference = torch.load(saved / "reference.pt", weights_only=False)  # the FSDP2 ranks' third step
    _assert_third_step_alike(reference["before"]["model"], reference["after"], ran["from_fsdp"])


def _assert_third_step_alike(before: dict, one: dict, other: dict) -> None:
    """Two layouts' third AdamW step from the same state: tests/numerics.py's rule, gradient-free (a key bias
    has no true gradient, so its update is rounding noise that AdamW scales by its own RMS)."""
    assert_adam_updates_close(before, one, other, lrs=[OPTIM.lr], first_step=3, betas=OPTIM.betas)


def _replica_rank_main(rank: int, world: int, out: str) -> None:
    """HSDP over 2 replicas x 2 shards: after two steps, a fresh model and trainer on each rank load the *other*
    replica's local state at the same position; one more step on both, which must stay bitwise equal."""
    import torch.distributed as dist

    from loopline.checkpoint.dcp import load_local_state, local_state, state_digest
    from loopline.training.parallel import full_model_state, parallelize, replica_mesh

    mesh, dp = replica_mesh(world, tp=1, replicas=2)

    def build() -> tuple[torch.nn.Module, PolicyTrainer]:
        model = parallelize(_model(), mesh)
        return model, PolicyTrainer(model, OPTIM, total_steps=10, group=dp.get_group())

    model, trainer = build()
    for seed in (1, 2):
        trainer.sft_step(split_rows(_batch(seed), 1)[rank], micro_batch_size=1)  # a row each
    states: list = [None] * world
    dist.all_gather_object(states, local_state(model, trainer))
    healed, healed_trainer = build()
    peer = (rank + world // 2) % world  # the same shards, in the other replica
    load_local_state(healed, healed_trainer, states[peer])
    bad = dict(states[peer], model={k: v for k, v in states[peer]["model"].items() if "embed" not in k})
    try:
        load_local_state(healed, healed_trainer, bad)
        error = ""
    except ValueError as e:
        error = str(e)
    for t in (trainer, healed_trainer):
        t.sft_step(split_rows(_batch(3), 1)[rank], micro_batch_size=1)
    want, got = full_model_state(model), full_model_state(healed)  # collectives: every rank takes part
    optim = (
        full_optimizer_state(model, trainer.optimizer),
        full_optimizer_state(healed, healed_trainer.optimizer),
    )
    if rank == 0:
        torch.save(
            {
                "want": want,
                "got": got,
                "optim": optim,
                "epochs": (trainer.scheduler.last_epoch, healed_trainer.scheduler.last_epoch),
                "local": states[0],
                "digests": [state_digest(state) for state in states],
                "error": error,
            },
            Path(out) / "replicas.pt",
        )


def test_a_replicas_local_state_heals_a_fresh_rank_at_the_same_mesh_position(tmp_path: Path) -> None:
    """What a healed trainer rank does (runtime.trainer_replicas): its fresh model and optimizer take the shards of
    the same position in another replica, as plain tensors, and then train exactly as the rank they replace."""
    run_world(_replica_rank_main, 4, args=(str(tmp_path),), timeout_s=180)
    out = torch.load(tmp_path / "replicas.pt", weights_only=False)
    assert out["want"].keys() == out["got"].keys()
    assert all(torch.equal(out["want"][k], out["got"][k]) for k in out["want"])
    _assert_equal_trees(out["optim"][1], out["optim"][0])
    assert out["epochs"] == (3, 3)
    # plain tensors, each half of the whole (2 shards): no DTensor crosses processes
    embed = out["local"]["model"]["model.embed_tokens.weight"]
    rows = out["want"]["model.embed_tokens.weight"].shape[0]
    assert type(embed) is torch.Tensor and embed.shape[0] == (rows + 1) // 2  # FSDP2's first shard: ceil
    digests = out["digests"]  # the replicas agree position by position; the two positions hold other shards
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]
    assert "replica state for state.model does not match" in out["error"] and "embed_tokens" in out["error"]
