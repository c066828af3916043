"""Weight sync across real gloo processes: a 2-rank FSDP2 trainer after one AdamW step -> engines, bitwise.

One world of 4 processes runs every scenario (start-up dominates on 2 cores): ranks 0-1 are the
trainer, ranks 2-3 hold engine weights (a whole model each at TP=1, or one engine's TP=2 shards);
the colocated scenario puts one TP=2 engine on the trainer ranks themselves. Ranks save what they
hold; the assertions run here, against the trainer's `get_model_state_dict(full_state_dict=True)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loopline.bench.sync import run_world, shard_model, trainer_mesh
from loopline.config import ModelConfig
from loopline.distributed.resharding import (
    EngineLayout,
    ParamSpec,
    TrainerLayout,
    TransferPlan,
    check_plan,
    default_tp_dim,
    plan_transfers,
)
from loopline.distributed.weight_sync import (
    empty_engine_shards,
    engine_tensors,
    local_shards,
    param_specs,
    sync_weights,
    sync_weights_naive,
)
from loopline.models import load_policy

WORLD = 4
TRAINER = 2
BUCKET_BYTES = 64 * 1024  # the 3.3 MB model goes in dozens of buckets
SCENARIOS = {
    # name: (engines, engine TP, colocated on the trainer ranks, method)
    "planned_2_engines_tp1": (2, 1, False, "planned"),
    "planned_1_engine_tp2": (1, 2, False, "planned"),
    "planned_colocated_tp2": (1, 2, True, "planned"),
    "naive_2_engines_tp1": (2, 1, False, "naive"),
    "naive_1_engine_tp2": (1, 2, False, "naive"),
}


def _plan(specs: list[ParamSpec], engines: int, tp: int, colocated: bool) -> TransferPlan:
    """The plan of one scenario: trainer FSDP over ranks 0-1; engines after them or on them."""
    return plan_transfers(
        specs,
        TrainerLayout(TRAINER),
        EngineLayout(engines, tp, ranks=tuple(range(tp)) if colocated else None),
    )


def _train_a_step(model: torch.nn.Module, mesh: DeviceMesh, rank: int, out: str) -> None:
    """Trainer rank: FSDP2 over `mesh`, one AdamW step; rank 0 saves the full weights after it as out/full.pt."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    shard_model(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 259, (4, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, Path(out, "full.pt"))


def _rank(rank: int, world: int, out: str) -> None:
    """One rank: train a step (trainer) or build a differently seeded model (engine), then run every scenario."""
    from torch.distributed.fsdp import fully_shard

    mesh = trainer_mesh(TRAINER)
    model, _ = load_policy(ModelConfig(), seed=0 if rank < TRAINER else 1)
    specs = param_specs(model)
    if rank < TRAINER:
        _train_a_step(model, mesh, rank, out)
        # FSDP2's own chunking of odd shapes, to hold the planner's rule against (3 rows: 2 + 1; 1 row: 1 + 0).
        odd = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(4, 1))
        for m in (odd[0], odd[1], odd):
            fully_shard(m, mesh=mesh)
        shapes = {n: list(p.to_local().shape) for n, p in odd.named_parameters()}
        Path(out, f"odd_rank{rank}.json").write_text(json.dumps(shapes))
    for name, (engines, tp, colocated, method) in SCENARIOS.items():
        plan = _plan(specs, engines, tp, colocated)
        src = local_shards(model) if plan.is_src(rank) else None
        dst = None
        if plan.dst_position(rank) is not None:
            dst = engine_tensors(model) if tp == 1 else empty_engine_shards(plan, rank)
            for t in dst.values():
                t.fill_(float("nan"))  # anything the sync misses stays NaN
        dist.barrier()
        if method == "naive":
            stats = sync_weights_naive(plan, src, dst)
        else:
            stats = sync_weights(plan, src, dst, bucket_bytes=BUCKET_BYTES)
        if dst is not None:
            held = model.state_dict() if tp == 1 else dst
            torch.save({k: v.clone() for k, v in held.items()}, Path(out, f"{name}_rank{rank}.pt"))
        Path(out, f"{name}_rank{rank}.json").write_text(json.dumps(vars(stats)))


@pytest.fixture(scope="module")
def synced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("weight_sync")
    run_world(_rank, WORLD, args=(str(out),), timeout_s=150)
    return out


def _stats(out: Path, name: str) -> list[dict]:
    return [json.loads(Path(out, f"{name}_rank{r}.json").read_text()) for r in range(WORLD)]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_trainer_took_a_step(synced: Path) -> None:
    full = torch.load(synced / "full.pt")
    init = load_policy(ModelConfig(), seed=0)[0].state_dict()
    assert full.keys() == init.keys()
    assert any(not torch.equal(full[k], init[k]) for k in full)


def test_fsdp2_chunks_odd_shapes_like_the_planner(synced: Path) -> None:
    from loopline.distributed.resharding import box_numel, trainer_shard_box

    for rank in range(TRAINER):
        shapes = json.loads((synced / f"odd_rank{rank}.json").read_text())
        for name, full_shape in {
            "0.weight": (3, 5),
            "0.bias": (3,),
            "1.weight": (1, 4),
            "1.bias": (1,),
        }.items():
            box = trainer_shard_box(full_shape, None, TrainerLayout(TRAINER), rank)
            assert shapes[name] == [hi - lo for lo, hi in box], (rank, name)
    assert box_numel(trainer_shard_box((1, 4), None, TrainerLayout(TRAINER), 1)) == 0


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_engines_bitwise_equal_to_trainer(synced: Path, name: str) -> None:
    engines, tp, colocated, _ = SCENARIOS[name]
    full = torch.load(synced / "full.pt")
    ranks = list(range(tp)) if colocated else list(range(TRAINER, TRAINER + engines * tp))
    for i, rank in enumerate(ranks):
        held = torch.load(synced / f"{name}_rank{rank}.pt")
        if tp == 1:  # a whole engine model: its full state dict (tied lm_head included) equals the trainer's
            assert held.keys() == full.keys()
            for k in full:
                assert _bitwise_equal(held[k], full[k]), (rank, k)
        else:  # TP shards, cut here with torch.chunk
            j = i % tp
            for k, got in held.items():
                d = default_tp_dim(k, tuple(full[k].shape))
                want = full[k] if d is None else full[k].chunk(tp, dim=d)[j]
                assert _bitwise_equal(got, want), (rank, k)


def test_planned_sync_moves_the_lower_bound_and_stages_a_bucket(synced: Path) -> None:
    specs = param_specs(load_policy(ModelConfig(), seed=0)[0])
    model_bytes = sum(s.nbytes for s in specs)
    largest = max(s.nbytes for s in specs)
    for name, (engines, tp, colocated, method) in SCENARIOS.items():
        stats = _stats(synced, name)
        report = check_plan(_plan(specs, engines, tp, colocated))
        if method == "planned":
            assert sum(s["bytes_sent"] for s in stats) == report.bytes_remote
            assert sum(s["bytes_received"] for s in stats) == report.bytes_remote
            assert sum(s["bytes_local"] for s in stats) == report.bytes_local
            assert report.bytes_remote + report.bytes_local == report.lower_bound
            assert max(s["peak_buffer_bytes"] for s in stats) <= max(BUCKET_BYTES, largest) + 1024
        else:  # the baseline holds a second full model on trainer rank 0
            assert stats[0]["peak_buffer_bytes"] >= model_bytes
            assert sum(s["bytes_received"] for s in stats) > report.lower_bound
    colocated = _stats(synced, "planned_colocated_tp2")
    assert all(colocated[r]["bytes_local"] > 0 for r in range(TRAINER))
    assert colocated[2]["bytes_sent"] == colocated[3]["bytes_sent"] == 0  # ranks 2-3 take no part


# ---------------------------------------------------------------------------------------------------------
# SyncGroup: the ray backend's communicator, rebuilt when an engine dies (here: threads of one process)
# ---------------------------------------------------------------------------------------------------------


def _in_threads(fn, members: list[int]) -> dict[int, object]:
    """fn(member) in one thread per member (gloo blocks until every member takes part); result or exception."""
    import threading

    out: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_sync_group_fails_fast_when_an_engine_is_gone_then_the_next_generation_syncs() -> None:
    from loopline.distributed.weight_sync import SyncError, SyncGroup, engines_plan

    trainer, _ = load_policy(ModelConfig(), seed=0)
    engines = [load_policy(ModelConfig(), seed=1 + e)[0] for e in range(2)]
    plan = engines_plan(param_specs(trainer), TrainerLayout(1), (0, 1))  # group ranks: trainer 0, engines 1-2
    # a timeout no run reaches: a failure within _in_threads' 120 s join can only come from the closed peer
    timeout_s = 3600.0
    server = SyncGroup.serve("127.0.0.1", timeout_s)
    groups = [server] + [SyncGroup.connect(server.address, "127.0.0.1", timeout_s) for _ in engines]

    def sync(i: int):
        src = local_shards(trainer) if i == 0 else None
        dst = engine_tensors(engines[i - 1]) if i > 0 else None
        return groups[i].sync(plan, src, dst, bucket_bytes=BUCKET_BYTES)

    _in_threads(lambda i: groups[i].open(1, i, 3), [0, 1, 2])
    groups[2].close()  # engine 1 is gone (as its process would be): its connections close
    failed = _in_threads(sync, [0, 1])
    # the trainer fails on the closed connection and closes its group, so engine 0 fails too: at once, not
    # at the (hour-long) timeout
    assert all(isinstance(failed.get(i), SyncError) for i in (0, 1)), failed
    assert groups[0].group is None and groups[1].group is None  # a failed sync leaves no half-open group

    groups[2] = SyncGroup.connect(server.address, "127.0.0.1", timeout_s)  # the replacement engine
    _in_threads(lambda i: groups[i].open(2, i, 3), [0, 1, 2])
    stats = _in_threads(sync, [0, 1, 2])
    assert all(not isinstance(s, Exception) for s in stats.values()), stats
    want = trainer.state_dict()
    for engine in engines:
        for k, v in engine.state_dict().items():
            assert _bitwise_equal(v, want[k]), k
    largest = max(s.nbytes for s in param_specs(trainer))
    assert max(s.peak_buffer_bytes for s in stats.values()) <= max(BUCKET_BYTES, largest) + 1024


def _moe_rank(rank: int, world: int, out: str) -> None:
    """The scaled-down Qwen3-MoE preset: a 2-rank FSDP2 trainer after one AdamW step -> 2 whole engines (planned)."""

    from tests.moe import tiny_moe

    model = tiny_moe(seed=0 if rank < TRAINER else 1)
    specs = param_specs(model)
    if rank < TRAINER:
        _train_a_step(model, trainer_mesh(TRAINER), rank, out)
    plan = _plan(specs, engines=2, tp=1, colocated=False)
    dst = engine_tensors(model) if plan.dst_position(rank) is not None else None
    for t in (dst or {}).values():
        t.fill_(float("nan"))
    sync_weights(plan, local_shards(model) if plan.is_src(rank) else None, dst, bucket_bytes=BUCKET_BYTES)
    if dst is not None:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(out, f"engine_rank{rank}.pt"))


def test_an_moe_models_experts_reach_every_engine_bitwise(tmp_path: Path) -> None:
    run_world(_moe_rank, WORLD, args=(str(tmp_path),), timeout_s=150)
    full = torch.load(tmp_path / "full.pt")
    experts = [k for k in full if k.endswith("experts.gate_up_proj")]
    assert experts and full[experts[0]].shape[0] == 128  # every expert, whole: FSDP2 held half on each rank
    for rank in range(TRAINER, WORLD):
        held = torch.load(tmp_path / f"engine_rank{rank}.pt")
        assert held.keys() == full.keys()
        for k in full:
            assert _bitwise_equal(held[k], full[k]), (rank, k)
