"""The pipeline's sizes, pure: how decoder layers split into stages, which stages a pp rank holds, and the
(micro-batches, width) a batch runs at. No torch: the config and the plan check a layout with them."""

from __future__ import annotations

import math


def check_pp(num_layers: int, pp: int, virtual: int = 1) -> None:
    """Raise ValueError unless `num_layers` split evenly into pp * virtual stages."""
    if pp < 1 or virtual < 1:
        raise ValueError(f"trainer_pp={pp} and trainer_pp_virtual={virtual} must be positive")
    if num_layers % (pp * virtual):
        raise ValueError(
            f"the model's {num_layers} decoder layers do not divide by trainer_pp * trainer_pp_virtual = "
            f"{pp} * {virtual} stages"
        )


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The decoder layers of each stage: equal contiguous runs, stage 0 first."""
    check_pp(num_layers, num_stages)
    per = num_layers // num_stages
    return [range(s * per, (s + 1) * per) for s in range(num_stages)]


def rank_stages(pp_rank: int, pp: int, virtual: int = 1) -> list[int]:
    """The stages pipeline rank `pp_rank` holds: pp_rank, pp_rank + pp, ... (the loop order torch's
    interleaved schedule expects); the first stage is on pp rank 0, the last on pp rank pp - 1."""
    return [pp_rank + k * pp for k in range(virtual)]


def padded_shape(rows: int, width: int, micro_batch_size: int, pp: int, bucket: int) -> tuple[int, int]:
    """(micro-batches, width) a batch of rows x width runs at: whole micro-batches, a multiple of pp of them
    (every schedule accepts that), and the width rounded up to a multiple of `bucket`."""
    n_micro = math.ceil(max(rows, 1) / micro_batch_size)
    return math.ceil(n_micro / pp) * pp, math.ceil(width / bucket) * bucket
