"""Transfer plans: hand-checked small layouts, real data through in-process copies, and a 70B plan at scale."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from loopline.distributed.resharding import (
    EngineLayout,
    ParamSpec,
    TrainerLayout,
    Transfer,
    TransferPlan,
    check_plan,
    chunk_bounds,
    default_tp_dim,
    llama_specs,
    plan_transfers,
    trainer_shard_box,
)
from loopline.distributed.weight_sync import copy_in_process, empty_engine_shards

F32 = torch.float32


def _t(src: int, dst: int, name: str, src_slice: tuple, dst_slice: tuple, nbytes: int) -> Transfer:
    return Transfer(
        src, dst, name, tuple(slice(*s) for s in src_slice), tuple(slice(*s) for s in dst_slice), nbytes
    )


# ---------------------------------------------------------------------------------------------
# Shard boxes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "parts"), [(10, 4), (5, 4), (2, 4), (6, 4), (8, 2), (1, 3), (0, 2)])
def test_chunk_bounds_follow_torch_chunk(size: int, parts: int) -> None:
    lengths = [len(c) for c in torch.arange(size).chunk(parts)] if size else []
    lengths += [0] * (parts - len(lengths))  # FSDP2 gives the ranks torch.chunk ran out for an empty shard
    assert np.diff(chunk_bounds(size, parts)).tolist() == lengths


def test_trainer_boxes_with_tp_follow_fsdp_inside_tp() -> None:
    layout = TrainerLayout(fsdp=2, tp=2)  # mesh index i*2 + j
    # Column-parallel (8, 2): TP rows 0:4 | 4:8, then FSDP halves each TP chunk.
    assert [trainer_shard_box((8, 2), 0, layout, m) for m in range(4)] == [
        ((0, 2), (0, 2)),  # i=0, j=0
        ((4, 6), (0, 2)),  # i=0, j=1
        ((2, 4), (0, 2)),  # i=1, j=0
        ((6, 8), (0, 2)),  # i=1, j=1
    ]
    # Row-parallel (2, 8): TP splits columns, FSDP splits the (full) rows.
    assert [trainer_shard_box((2, 8), 1, layout, m) for m in range(4)] == [
        ((0, 1), (0, 4)),
        ((0, 1), (4, 8)),
        ((1, 2), (0, 4)),
        ((1, 2), (4, 8)),
    ]


def test_default_tp_rule() -> None:
    assert default_tp_dim("model.layers.0.self_attn.q_proj.weight", (8, 8)) == 0
    assert default_tp_dim("model.layers.0.self_attn.k_proj.bias", (8,)) == 0
    assert default_tp_dim("model.layers.0.mlp.down_proj.weight", (8, 32)) == 1
    assert default_tp_dim("model.layers.0.self_attn.o_proj.bias", (8,)) is None
    assert default_tp_dim("model.norm.weight", (8,)) is None
    assert default_tp_dim("lm_head.weight", (259, 8)) == 0


# ---------------------------------------------------------------------------------------------
# Hand-checked plans
# ---------------------------------------------------------------------------------------------


def test_uneven_dim0() -> None:
    # (5, 3) over 2 FSDP ranks: ceil(5/2) = 3 rows, then 2. One engine, TP=1, on rank 2.
    plan = plan_transfers([ParamSpec("w", (5, 3), F32)], TrainerLayout(2), EngineLayout(1))
    assert list(plan.transfers()) == [
        _t(0, 2, "w", ((0, 3), (0, 3)), ((0, 3), (0, 3)), 36),
        _t(1, 2, "w", ((0, 2), (0, 3)), ((3, 5), (0, 3)), 24),
    ]
    assert check_plan(plan).exact


def test_more_fsdp_ranks_than_rows() -> None:
    # (2, 4) over 4 FSDP ranks: ranks 2 and 3 hold nothing and send nothing. Engines on ranks 4, 5.
    plan = plan_transfers([ParamSpec("w", (2, 4), F32)], TrainerLayout(4), EngineLayout(2))
    assert list(plan.transfers()) == [
        _t(0, 4, "w", ((0, 1), (0, 4)), ((0, 1), (0, 4)), 16),
        _t(1, 4, "w", ((0, 1), (0, 4)), ((1, 2), (0, 4)), 16),
        _t(0, 5, "w", ((0, 1), (0, 4)), ((0, 1), (0, 4)), 16),
        _t(1, 5, "w", ((0, 1), (0, 4)), ((1, 2), (0, 4)), 16),
    ]
    assert plan.transfers_from(2) == plan.transfers_from(3) == []
    report = check_plan(plan)
    assert report.exact and report.bytes_moved == report.lower_bound == 64


def test_column_vs_row_parallel() -> None:
    # (4, 6) over 2 FSDP ranks (2 rows each) into one engine at TP=2 on ranks 2, 3.
    specs = [ParamSpec("a.q_proj.weight", (4, 6), F32), ParamSpec("a.o_proj.weight", (4, 6), F32)]
    plan = plan_transfers(specs, TrainerLayout(2), EngineLayout(1, 2))
    # Column-parallel: TP rank j wants rows 2j:2j+2, which is exactly FSDP rank j's shard.
    assert list(plan.transfers([0])) == [
        _t(0, 2, "a.q_proj.weight", ((0, 2), (0, 6)), ((0, 2), (0, 6)), 48),
        _t(1, 3, "a.q_proj.weight", ((0, 2), (0, 6)), ((0, 2), (0, 6)), 48),
    ]
    # Row-parallel: TP rank j wants columns 3j:3j+3 of all rows, so it hears from both FSDP ranks.
    assert list(plan.transfers([1])) == [
        _t(0, 2, "a.o_proj.weight", ((0, 2), (0, 3)), ((0, 2), (0, 3)), 24),
        _t(1, 2, "a.o_proj.weight", ((0, 2), (0, 3)), ((2, 4), (0, 3)), 24),
        _t(0, 3, "a.o_proj.weight", ((0, 2), (3, 6)), ((0, 2), (0, 3)), 24),
        _t(1, 3, "a.o_proj.weight", ((0, 2), (3, 6)), ((2, 4), (0, 3)), 24),
    ]
    assert check_plan(plan).exact


def test_replicated_param_goes_whole_to_every_tp_rank() -> None:
    plan = plan_transfers([ParamSpec("model.norm.weight", (4,), F32)], TrainerLayout(2), EngineLayout(1, 2))
    assert list(plan.transfers()) == [
        _t(0, 2, "model.norm.weight", ((0, 2),), ((0, 2),), 8),
        _t(1, 2, "model.norm.weight", ((0, 2),), ((2, 4),), 8),
        _t(0, 3, "model.norm.weight", ((0, 2),), ((0, 2),), 8),
        _t(1, 3, "model.norm.weight", ((0, 2),), ((2, 4),), 8),
    ]
    report = check_plan(plan)
    assert report.exact and report.lower_bound == 32  # both TP ranks hold all 16 bytes


def test_colocated_counts_local_and_crossing_bytes() -> None:
    specs = [
        ParamSpec("a.o_proj.weight", (4, 6), F32),
        ParamSpec("a.q_proj.weight", (4, 6), F32),
        ParamSpec("n.weight", (4,), F32),
    ]
    plan = plan_transfers(specs, TrainerLayout(2), EngineLayout(1, 2, ranks=(0, 1)))
    report = check_plan(plan)
    # q_proj: both 48-byte rows stay local. o_proj: 2 of 4 24-byte blocks. norm: 2 of 4 8-byte blocks.
    assert (report.bytes_local, report.bytes_remote) == (96 + 48 + 16, 48 + 16)
    assert report.bytes_moved == report.lower_bound == 96 + 96 + 32
    assert report.max_rank_send == 24 + 8  # rank 0 sends its o_proj block and norm half to rank 1


def test_transfer_views_partition_the_plan() -> None:
    specs = llama_specs(layers=2, hidden=16, intermediate=40, heads=4, kv_heads=2, vocab=37, dtype=F32)
    plan = plan_transfers(specs, TrainerLayout(3, 2), EngineLayout(2, 2))
    every = list(plan.transfers())
    assert len(every) == len(plan)
    by_src = [t for r in range(6) for t in plan.transfers_from(r)]
    by_dst = [t for r in range(6, 10) for t in plan.transfers_to(r)]
    key = lambda t: (t.src_rank, t.dst_rank, t.name, str(t.src_slice))  # noqa: E731
    assert sorted(map(key, by_src)) == sorted(map(key, by_dst)) == sorted(map(key, every))


# ---------------------------------------------------------------------------------------------
# Real data: shards cut with torch.chunk, copied in process, compared bitwise
# ---------------------------------------------------------------------------------------------


def _chunk_padded(t: torch.Tensor, parts: int, dim: int) -> list[torch.Tensor]:
    """torch.chunk, plus empty chunks for the ranks it ran out for."""
    chunks = list(t.chunk(parts, dim=dim)) if t.shape[dim] else []
    return chunks + [t.narrow(dim, 0, 0)] * (parts - len(chunks))


def _trainer_shards_by_torch(
    full: torch.Tensor, tp_dim: int | None, fsdp: int, tp: int
) -> list[torch.Tensor]:
    """What FSDP2 x TP leave on each mesh index i*tp + j, cut with torch.chunk (independent of the planner)."""
    tp_parts = _chunk_padded(full, tp, tp_dim) if tp_dim is not None else [full] * tp
    fsdp_parts = [_chunk_padded(part, fsdp, 0) for part in tp_parts]
    return [fsdp_parts[j][i] for i in range(fsdp) for j in range(tp)]


@pytest.mark.parametrize(
    ("fsdp", "trainer_tp", "engines", "engine_tp", "colocated"),
    [(3, 1, 1, 1, False), (4, 1, 2, 2, False), (3, 2, 2, 2, False), (2, 2, 1, 4, True), (5, 1, 1, 2, True)],
)
def test_in_process_copy_is_bitwise(
    fsdp: int, trainer_tp: int, engines: int, engine_tp: int, colocated: bool
) -> None:
    specs = [
        ParamSpec("model.embed_tokens.weight", (7, 4), F32),
        ParamSpec("l.self_attn.k_proj.weight", (2, 4), F32),  # fewer rows than FSDP ranks
        ParamSpec("l.self_attn.k_proj.bias", (2,), F32),
        ParamSpec("l.self_attn.o_proj.weight", (4, 9), F32),  # uneven TP split of dim 1
        ParamSpec("l.mlp.down_proj.weight", (4, 8), torch.bfloat16),
        ParamSpec("l.input_layernorm.weight", (4,), torch.float16),
    ]
    trainer = TrainerLayout(fsdp, trainer_tp)
    ranks = tuple(range(engines * engine_tp)) if colocated else None
    plan = plan_transfers(specs, trainer, EngineLayout(engines, engine_tp, ranks))
    assert check_plan(plan).exact
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen).to(s.dtype) for s in specs}
    shards: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(trainer.size)}
    for p, s in enumerate(specs):
        for m, shard in enumerate(_trainer_shards_by_torch(full[s.name], plan.tp_dims[p], fsdp, trainer_tp)):
            shards[m][s.name] = shard
    targets = {int(r): empty_engine_shards(plan, int(r)) for r in plan.dst_ranks.reshape(-1)}
    for tensors in targets.values():
        for t in tensors.values():
            t.fill_(float("nan"))
    copied = copy_in_process(plan, shards, targets)
    assert copied == check_plan(plan).lower_bound
    for (e, j), r in np.ndenumerate(plan.dst_ranks):
        for p, s in enumerate(specs):
            d = plan.tp_dims[p]
            want = _chunk_padded(full[s.name], engine_tp, d)[j] if d is not None else full[s.name]
            got = targets[int(r)][s.name]
            assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                e,
                j,
                s,
            )


@pytest.mark.parametrize(
    ("pp", "fsdp", "trainer_tp", "engine_tp"), [(2, 1, 1, 1), (2, 2, 2, 2), (4, 1, 2, 1)]
)
def test_pipeline_stages_send_only_their_own_parameters_and_engines_get_the_whole_model(
    pp: int, fsdp: int, trainer_tp: int, engine_tp: int
) -> None:
    """A (pp, fsdp, tp) trainer: each parameter comes from the ranks of the pipeline stage that holds it (layers by
    layer_stages, embeddings first, norm and head last), and the engines receive every byte once, bitwise."""
    specs = llama_specs(layers=4, hidden=8, intermediate=12, heads=2, kv_heads=1, vocab=11, dtype=F32)
    layer_stages = tuple(i * pp // 4 for i in range(4))
    trainer = TrainerLayout(fsdp, trainer_tp, pp=pp, layer_stages=layer_stages)
    plan = plan_transfers(specs, trainer, EngineLayout(2, engine_tp))
    report = check_plan(plan)
    assert report.exact, report.problems
    assert report.bytes_moved == report.lower_bound
    per = fsdp * trainer_tp
    want_stage = {"model.embed_tokens.weight": 0, "model.norm.weight": pp - 1, "lm_head.weight": pp - 1}
    want_stage |= {s.name: layer_stages[int(s.name.split(".")[2])] for s in specs if ".layers." in s.name}
    for rank in range(trainer.size):
        sent = {t.name for t in plan.transfers_from(rank)}
        assert sent <= {n for n, st in want_stage.items() if st == rank // per}, rank
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in specs}
    shards: dict[int, dict[str, torch.Tensor]] = {
        r: {} for r in range(trainer.size)
    }  # only their stage's names
    for p, s in enumerate(specs):
        pieces = _trainer_shards_by_torch(full[s.name], plan.tp_dims[p], fsdp, trainer_tp)
        for m, shard in enumerate(pieces):
            shards[want_stage[s.name] * per + m][s.name] = shard
    targets = {int(r): empty_engine_shards(plan, int(r)) for r in plan.dst_ranks.reshape(-1)}
    assert copy_in_process(plan, shards, targets) == report.lower_bound
    for (_, j), r in np.ndenumerate(plan.dst_ranks):
        for p, s in enumerate(specs):
            d = plan.tp_dims[p]
            want = _chunk_padded(full[s.name], engine_tp, d)[j] if d is not None else full[s.name]
            assert torch.equal(targets[int(r)][s.name], want), (r, s.name)
    with pytest.raises(ValueError, match="layer_stages"):
        TrainerLayout(2, pp=2)
    with pytest.raises(ValueError, match="outside 0..1"):
        TrainerLayout(2, pp=2, layer_stages=(0, 2))


def test_in_process_copy_fills_only_the_engine_ranks_given() -> None:
    """The local sync: each engine copies its own part of the plan; a rank the plan has no engine on is refused."""
    specs = [ParamSpec("a.q_proj.weight", (5, 3), F32), ParamSpec("a.o_proj.weight", (3, 5), F32)]
    plan = plan_transfers(specs, TrainerLayout(2), EngineLayout(2, 2))  # engine ranks 2,3 and 4,5
    gen = torch.Generator().manual_seed(0)
    full = {s.name: torch.randn(s.shape, generator=gen) for s in specs}
    shards = {m: {} for m in range(2)}
    for p, s in enumerate(specs):
        for m, shard in enumerate(_trainer_shards_by_torch(full[s.name], plan.tp_dims[p], 2, 1)):
            shards[m][s.name] = shard
    targets = {r: empty_engine_shards(plan, r) for r in (2, 3, 4, 5)}
    for tensors in targets.values():
        for t in tensors.values():
            t.fill_(float("nan"))
    copied = copy_in_process(plan, shards, {4: targets[4]})
    assert copied == sum(t.nbytes for t in plan.transfers_to(4))
    assert not any(t.isnan().any() for t in targets[4].values())
    assert all(t.isnan().all() for r in (2, 3, 5) for t in targets[r].values())
    with pytest.raises(ValueError, match="rank 1 holds no engine shard"):
        copy_in_process(plan, shards, {1: targets[2]})


# ---------------------------------------------------------------------------------------------
# The checker is not vacuous
# ---------------------------------------------------------------------------------------------


def _tampered(plan: TransferPlan, **arrays: np.ndarray) -> TransferPlan:
    """The plan with some arrays of its first class replaced."""
    cls = dataclasses.replace(plan.classes[0], **arrays)
    return dataclasses.replace(plan, classes=(cls, *plan.classes[1:]))


def test_checker_catches_gaps_overlaps_and_wrong_sources() -> None:
    plan = plan_transfers([ParamSpec("a.o_proj.weight", (6, 4), F32)], TrainerLayout(3), EngineLayout(2, 2))
    cls = plan.classes[0]
    assert check_plan(plan).exact
    keep = np.arange(len(cls)) != 1
    dropped = _tampered(plan, **{k: getattr(cls, k)[keep] for k in ("src", "dst_tp", "lo", "hi")},
                        src_origin=cls.src_origin[keep], dst_origin=cls.dst_origin[keep])  # fmt: skip
    assert not check_plan(dropped).exact
    dup = np.r_[np.arange(len(cls)), 0]
    doubled = _tampered(plan, **{k: getattr(cls, k)[dup] for k in ("src", "dst_tp", "lo", "hi")},
                        src_origin=cls.src_origin[dup], dst_origin=cls.dst_origin[dup])  # fmt: skip
    report = check_plan(doubled)
    assert not report.exact and report.bytes_moved > report.lower_bound
    wrong_src = _tampered(plan, src=(cls.src + 1) % 3)  # same boxes, read from a rank that lacks them
    assert not check_plan(wrong_src).exact
    # Two boxes swapped halves: same total bytes, but one cell covered twice and one not at all.
    lo, hi = cls.lo.copy(), cls.hi.copy()
    lo[0, 0], hi[0, 0] = lo[1, 0], hi[1, 0]
    overlap = _tampered(plan, lo=lo, hi=hi)
    assert any("exactly once" in p or "outside" in p for p in check_plan(overlap).problems)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="out of range"):
        plan_transfers([ParamSpec("w", (4,), F32)], TrainerLayout(2), EngineLayout(1), tp_dims={"w": 1})
    with pytest.raises(ValueError, match="distinct"):
        EngineLayout(1, 2, ranks=(0, 0))
    with pytest.raises(ValueError, match="scalar"):
        plan_transfers([ParamSpec("s", (), F32)], TrainerLayout(2), EngineLayout(1))
    with pytest.raises(ValueError, match="positive"):
        TrainerLayout(0)


# ---------------------------------------------------------------------------------------------
# At scale, without ranks: Llama-70B from 4,096 trainer ranks (FSDP, FSDP x TP, PP x FSDP x TP) to 512 engines at TP=8
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "trainer", "colocated"),
    [("fsdp4096", TrainerLayout(4096), False), ("fsdp4096_colocated", TrainerLayout(4096), True),
     ("fsdp512xtp8_colocated", TrainerLayout(512, 8), True),
     ("pp8xfsdp64xtp8_colocated", TrainerLayout(64, 8, pp=8, layer_stages=tuple(i // 10 for i in range(80))), True)],
)  # fmt: skip
def test_plan_70b_at_scale(name: str, trainer: TrainerLayout, colocated: bool) -> None:
    specs = llama_specs()  # 80 layers, hidden 8192, intermediate 28672, 64/8 heads, vocab 128256, bf16
    assert sum(s.nbytes for s in specs) == 2 * 70_553_706_496
    engines = EngineLayout(512, 8, ranks=tuple(range(4096)) if colocated else None)
    start = time.perf_counter()
    plan = plan_transfers(specs, trainer, engines)
    plan_s = time.perf_counter() - start
    report = check_plan(plan)
    check_s = time.perf_counter() - start - plan_s
    print(
        f"\n{name}: plan {plan_s:.3f}s check {check_s:.3f}s transfers {report.num_transfers:,} "
        f"moved {report.bytes_moved:,} lower bound {report.lower_bound:,} "
        f"ratio {report.moved_over_lower_bound:.6f} local {report.bytes_local:,} remote {report.bytes_remote:,} "
        f"naive {report.naive_bytes:,} max rank send {report.max_rank_send:,} (naive {report.naive_max_rank_send:,})"
    )
    assert report.exact, report.problems
    assert report.bytes_moved == report.lower_bound  # every engine byte received exactly once
    # The lower bound itself: each engine holds one model plus 7 extra copies of the replicated norms.
    norms = sum(s.nbytes for s in specs if len(s.shape) == 1)
    assert report.lower_bound == 512 * (sum(s.nbytes for s in specs) + 7 * norms)
    assert report.num_transfers > 100_000_000  # too many to list: the templates hold ~1e5 rows
    assert plan_s + check_s < 30.0
    if colocated and trainer.tp == 8:
        # Every trainer shard lands in place once; a norm shard i also feeds TP ranks j of engine i (8 copies).
        assert report.bytes_local == sum(s.nbytes for s in specs) + 7 * norms
