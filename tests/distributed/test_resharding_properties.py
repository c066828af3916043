"""Property-based tests (Hypothesis) of the transfer planner: for random parameter lists and layouts,
replaying the plan on real data fills every destination element exactly once, with the right values.

The check here is independent of `check_plan`: each parameter is an arange, each trainer rank holds the
slice `full[src_box]` given by the layout, and the transfers are executed into per-engine-rank buffers
whose writes are counted.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loopline.distributed.resharding import (
    EngineLayout,
    ParamSpec,
    TrainerLayout,
    check_plan,
    engine_shard_box,
    plan_transfers,
    trainer_shard_box,
)

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64]


@st.composite
def problems(draw):
    """(params, tp_dims rule, trainer layout, engine layout) with small random shapes and rank ids."""
    count = draw(st.integers(1, 4))
    params, rule = [], {}
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        params.append(ParamSpec(f"p{i}", shape, draw(st.sampled_from(DTYPES))))
        rule[f"p{i}"] = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
    fsdp, ttp = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    engines, etp = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    trainer_ranks = draw(st.permutations(range(fsdp * ttp)))
    trainer = TrainerLayout(fsdp, ttp, ranks=tuple(trainer_ranks))
    if draw(st.booleans()):  # colocated: engine ranks drawn from (and beyond) the trainer's
        pool = range(fsdp * ttp + engines * etp)
        engine_ranks = tuple(draw(st.permutations(pool))[: engines * etp])
        engine = EngineLayout(engines, etp, ranks=engine_ranks)
    else:
        engine = EngineLayout(engines, etp)
    return params, rule, trainer, engine


def _region(full: torch.Tensor, box) -> torch.Tensor:
    return full[tuple(slice(lo, hi) for lo, hi in box)]


@settings(max_examples=60, deadline=None)
@given(problems())
def test_replaying_the_plan_writes_every_destination_element_once(problem):
    params, rule, trainer, engine = problem
    plan = plan_transfers(params, trainer, engine, tp_dims=rule)
    dst_ranks = engine.global_ranks(first=max(trainer.global_ranks()) + 1)
    moved = 0
    for p, spec in enumerate(params):
        full = torch.arange(math.prod(spec.shape), dtype=torch.float64).view(spec.shape)
        tp_dim = rule[spec.name]
        shards = {  # what each trainer rank holds, from the layout alone
            int(r): _region(full, trainer_shard_box(spec.shape, tp_dim, trainer, m))
            for m, r in enumerate(trainer.global_ranks())
        }
        buffers, counts = {}, {}
        for e in range(engine.engines):
            for j in range(engine.tp):
                box = engine_shard_box(spec.shape, tp_dim, engine.tp, j)
                rank = int(dst_ranks[e, j])
                buffers[rank] = torch.full_like(_region(full, box), -1.0)
                counts[rank] = torch.zeros_like(buffers[rank])
        for t in plan.transfers([p]):
            assert t.name == spec.name
            piece = shards[t.src_rank][t.src_slice]
            assert piece.numel() > 0  # no empty transfers
            buffers[t.dst_rank][t.dst_slice] = piece
            counts[t.dst_rank][t.dst_slice] += 1
            assert t.nbytes == piece.numel() * spec.dtype.itemsize
            moved += t.nbytes
        for e in range(engine.engines):
            for j in range(engine.tp):
                rank = int(dst_ranks[e, j])
                box = engine_shard_box(spec.shape, tp_dim, engine.tp, j)
                assert torch.all(counts[rank] == 1), (
                    f"{spec.name}: engine {e} rank {j} not covered exactly once"
                )
                torch.testing.assert_close(buffers[rank], _region(full, box))
    report = check_plan(plan)
    assert report.exact and report.bytes_moved == moved == report.lower_bound
    assert len(plan) == len(list(plan.transfers()))
