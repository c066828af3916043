"""Transfer plans from a trainer layout (FSDP2 x TP) to engine layouts (replicas x TP), and their checker.

A plan is a pure function of the two layouts and the parameter list (names, shapes, dtypes): no
tensors, no processes. So it can be built and checked for thousands of ranks on a laptop.

Coordinates: every shard is a box in its parameter's global index space, one `[lo, hi)` per dim.
A transfer moves the intersection of one source shard box and one destination shard box.

Why it scales: every engine holds the same layout, and every byte lives on exactly one trainer
rank (a TP-replicated byte on one of `tp` ranks, picked by the engine's TP index). So the
transfers into engine `e` are those into engine 0 with the destination ranks renamed, and
parameters of the same (shape, dtype, TP dim) share them. A plan stores one *template* per such
class (numpy arrays over engine 0's ranks) and expands transfers lazily, per rank or in full.

The layouts, shard boxes and parameter lists live in `shard_layout`; they are re-exported here, where callers
import them from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import product

import numpy as np

from loopline.distributed.shard_layout import (
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    Box,
    EngineLayout,
    ParamSpec,
    TpRule,
    TrainerLayout,
    box_numel,
    chunk_bounds,
    default_tp_dim,
    engine_shard_box,
    llama_specs,
    resolve_tp_dim,
    trainer_shard_box,
)

__all__ = [
    # from shard_layout
    "COLUMN_PARALLEL",
    "ROW_PARALLEL",
    "Box",
    "EngineLayout",
    "ParamSpec",
    "TpRule",
    "TrainerLayout",
    "box_numel",
    "chunk_bounds",
    "default_tp_dim",
    "engine_shard_box",
    "llama_specs",
    "resolve_tp_dim",
    "trainer_shard_box",
    # the plan and its checker
    "ClassPlan",
    "PlanReport",
    "Transfer",
    "TransferPlan",
    "check_plan",
    "plan_transfers",
]


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """Move `src[src_slice]` on `src_rank` into `dst[dst_slice]` on `dst_rank` for parameter `name`."""

    src_rank: int
    dst_rank: int
    name: str
    src_slice: tuple[slice, ...]
    dst_slice: tuple[slice, ...]
    nbytes: int


@dataclass(frozen=True)
class ClassPlan:
    """Transfers into engine 0 for every parameter of one (shape, dtype, TP dim) class; one row per transfer.

    Boxes are global; a local slice is the box minus its shard's origin (`src_origin`, `dst_origin`).
    """

    shape: tuple[int, ...]
    itemsize: int
    tp_dim: int | None
    src: np.ndarray  # (T,) trainer mesh index
    dst_tp: np.ndarray  # (T,) TP rank inside the engine
    lo: np.ndarray  # (T, ndim) global box start
    hi: np.ndarray  # (T, ndim) global box end
    src_origin: np.ndarray  # (T, ndim) start of the source shard's box
    dst_origin: np.ndarray  # (T, ndim) start of the destination shard's box

    @property
    def nbytes(self) -> np.ndarray:
        """Bytes of each transfer, shape (T,)."""
        return np.prod(self.hi - self.lo, axis=1, dtype=np.int64) * self.itemsize

    def __len__(self) -> int:
        return len(self.src)


@dataclass(frozen=True)
class TransferPlan:
    """Every transfer from a trainer layout to an engine layout, stored as per-class templates."""

    params: tuple[ParamSpec, ...]
    tp_dims: tuple[int | None, ...]
    trainer: TrainerLayout
    engines: EngineLayout
    src_ranks: np.ndarray  # (trainer.size,) global rank of each trainer mesh index
    dst_ranks: np.ndarray  # (engines, tp) global rank of each engine TP rank
    class_of: tuple[int, ...]  # class index of each parameter
    classes: tuple[ClassPlan, ...]
    stages: tuple[
        int, ...
    ]  # pipeline rank holding each parameter (templates index that rank's (fsdp, tp) mesh)
    _src_index: dict[int, int] = field(repr=False, compare=False)
    _dst_index: dict[int, tuple[int, int]] = field(repr=False, compare=False)
    _into: dict[int, tuple[Transfer, ...]] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        """Number of transfers, counted without expanding them."""
        return self.engines.engines * sum(len(self.classes[c]) for c in self.class_of)

    def is_src(self, rank: int) -> bool:
        """Whether `rank` is a trainer rank."""
        return rank in self._src_index

    def dst_position(self, rank: int) -> tuple[int, int] | None:
        """(engine, TP rank) of a global rank, or None if it holds no engine shard."""
        return self._dst_index.get(rank)

    def dst_box(self, p: int, j: int) -> Box:
        """Region of parameter `p` held by engine TP rank `j`."""
        return engine_shard_box(self.params[p].shape, self.tp_dims[p], self.engines.tp, j)

    def src_box(self, p: int, rank: int) -> Box:
        """Region of parameter `p` held by trainer rank `rank` (global); empty on another pipeline stage's rank."""
        shape = self.params[p].shape
        stage, index = divmod(self._src_index[rank], self.trainer.stage_size)
        if stage != self.stages[p]:
            return tuple((0, 0) for _ in shape)
        return trainer_shard_box(shape, self.tp_dims[p], self.trainer, index)

    def transfers(self, params: Sequence[int] | None = None) -> Iterator[Transfer]:
        """All transfers of the given parameter indices (default all), by parameter, engine, template row."""
        for p in range(len(self.params)) if params is None else params:
            cls = self.classes[self.class_of[p]]
            for e in range(self.engines.engines):
                for r in range(len(cls)):
                    yield self._transfer(p, cls, r, e)

    def transfers_from(self, rank: int, params: Sequence[int] | None = None) -> list[Transfer]:
        """Transfers a trainer rank sends, ordered by parameter, engine, template row."""
        m = self._src_index.get(rank)
        if m is None:
            return []
        stage, index = divmod(m, self.trainer.stage_size)
        out: list[Transfer] = []
        for p in range(len(self.params)) if params is None else params:
            if self.stages[p] != stage:
                continue
            cls = self.classes[self.class_of[p]]
            rows = np.flatnonzero(cls.src == index)
            out.extend(self._transfer(p, cls, int(r), e) for e in range(self.engines.engines) for r in rows)
        return out

    def transfers_to(self, rank: int, params: Sequence[int] | None = None) -> list[Transfer]:
        """Transfers an engine rank receives, ordered by parameter, template row."""
        pos = self._dst_index.get(rank)
        if pos is None:
            return []
        if params is None:  # all of them: expanded once per plan (the local sync runs them at every push)
            if rank not in self._into:
                self._into[rank] = tuple(self.transfers_to(rank, range(len(self.params))))
            return list(self._into[rank])
        e, j = pos
        out: list[Transfer] = []
        for p in range(len(self.params)) if params is None else params:
            cls = self.classes[self.class_of[p]]
            out.extend(self._transfer(p, cls, int(r), e) for r in np.flatnonzero(cls.dst_tp == j))
        return out

    def buckets(self, bucket_bytes: int) -> list[list[int]]:
        """Consecutive parameter indices grouped so each group's full size is <= bucket_bytes (big ones alone)."""
        groups: list[list[int]] = []
        size = 0
        for p, spec in enumerate(self.params):
            if groups and size + spec.nbytes <= bucket_bytes:
                groups[-1].append(p)
                size += spec.nbytes
            else:
                groups.append([p])
                size = spec.nbytes
        return groups

    def _transfer(self, p: int, cls: ClassPlan, r: int, e: int) -> Transfer:
        lo, hi = cls.lo[r], cls.hi[r]
        so, do = cls.src_origin[r], cls.dst_origin[r]
        return Transfer(
            src_rank=int(self.src_ranks[self.stages[p] * self.trainer.stage_size + cls.src[r]]),
            dst_rank=int(self.dst_ranks[e, cls.dst_tp[r]]),
            name=self.params[p].name,
            src_slice=tuple(slice(int(a - o), int(b - o)) for a, b, o in zip(lo, hi, so)),
            dst_slice=tuple(slice(int(a - o), int(b - o)) for a, b, o in zip(lo, hi, do)),
            nbytes=int(math.prod(int(b - a) for a, b in zip(lo, hi)) * cls.itemsize),
        )


def plan_transfers(
    params: Sequence[ParamSpec],
    trainer: TrainerLayout,
    engines: EngineLayout,
    tp_dims: TpRule = default_tp_dim,
) -> TransferPlan:
    """Map each trainer shard onto the engine shards that need it; every engine byte is received once."""
    specs = tuple(params)
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("parameter names must be unique")
    dims = tuple(resolve_tp_dim(tp_dims, s) for s in specs)
    for s in specs:
        if len(s.shape) == 0:
            raise ValueError(f"'{s.name}' is a scalar; FSDP2 shards dim 0, give it shape (1,)")
    src_ranks = trainer.global_ranks()
    dst_ranks = engines.global_ranks(first=int(src_ranks.max()) + 1)

    keys: dict[tuple, int] = {}
    classes: list[ClassPlan] = []
    class_of = []
    for s, d in zip(specs, dims):
        key = (s.shape, s.dtype.itemsize, d)
        if key not in keys:  # parameters of the same class share one template: 80 layers cost one
            keys[key] = len(classes)
            classes.append(_plan_class(s.shape, s.dtype.itemsize, d, trainer, engines.tp))
        class_of.append(keys[key])

    return TransferPlan(
        params=specs,
        tp_dims=dims,
        trainer=trainer,
        engines=engines,
        src_ranks=src_ranks,
        dst_ranks=dst_ranks,
        class_of=tuple(class_of),
        classes=tuple(classes),
        stages=tuple(trainer.stage_of(s.name) for s in specs),
        _src_index={int(r): m for m, r in enumerate(src_ranks)},
        _dst_index={int(r): (e, j) for (e, j), r in np.ndenumerate(dst_ranks)},
    )


def _source_grid(
    shape: tuple[int, ...], tp_dim: int | None, layout: TrainerLayout
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per dim, the sorted non-empty source intervals (lo, hi) and each one's share of the mesh index.

    A trainer shard is the product of one interval per dim and its mesh index is the sum of the shares;
    for a TP-replicated parameter the TP share is added later (a choice of replica).
    """
    n, t = layout.fsdp, layout.tp  # of one pipeline rank's mesh: its parameters' shards
    grid = []
    for d, size in enumerate(shape):
        if d == 0 and tp_dim == 0 and t > 1:  # FSDP chunks inside each TP chunk
            tb = chunk_bounds(size, t)
            fb = [tb[j] + chunk_bounds(int(tb[j + 1] - tb[j]), n) for j in range(t)]
            lo = np.concatenate([b[:-1] for b in fb])
            hi = np.concatenate([b[1:] for b in fb])
            share = np.concatenate([np.arange(n) * t + j for j in range(t)])
        elif d == 0:
            b = chunk_bounds(size, n)
            lo, hi, share = b[:-1], b[1:], np.arange(n) * t
        elif d == tp_dim and t > 1:
            b = chunk_bounds(size, t)
            lo, hi, share = b[:-1], b[1:], np.arange(t)
        else:
            lo, hi, share = np.zeros(1, np.int64), np.full(1, size, np.int64), np.zeros(1, np.int64)
        keep = hi > lo  # ranks past the end of dim 0 hold nothing
        grid.append((lo[keep], hi[keep], share[keep]))
    return grid


def _plan_class(
    shape: tuple[int, ...], itemsize: int, tp_dim: int | None, trainer: TrainerLayout, engine_tp: int
) -> ClassPlan:
    """Template transfers into one engine: per dim, the source intervals overlapping the destination box."""
    grid = _source_grid(shape, tp_dim, trainer)
    replicated = tp_dim is None and trainer.tp > 1
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("src", "dst_tp", "lo", "hi", "so", "do")}
    for j in range(engine_tp):
        box = engine_shard_box(shape, tp_dim, engine_tp, j)
        if box_numel(box) == 0:
            continue
        per_dim = []
        for (lo, hi, share), (a, b) in zip(grid, box):
            first, last = np.searchsorted(hi, a, side="right"), np.searchsorted(lo, b, side="left")
            sl = slice(first, last)
            per_dim.append((np.maximum(lo[sl], a), np.minimum(hi[sl], b), share[sl], lo[sl]))
        # Cartesian product over dims: one transfer per (interval in dim 0) x (interval in dim 1) ...
        idx = [i.reshape(-1) for i in np.meshgrid(*[np.arange(len(x[0])) for x in per_dim], indexing="ij")]
        src: np.ndarray | int = sum(x[2][i] for x, i in zip(per_dim, idx))
        if replicated:
            src = src + j % trainer.tp  # pick replica j % tp: spreads engine TP ranks over the copies
        cols["src"].append(np.asarray(src, dtype=np.int64))
        cols["dst_tp"].append(np.full(len(idx[0]), j, dtype=np.int64))
        cols["lo"].append(np.stack([x[0][i] for x, i in zip(per_dim, idx)], axis=1))
        cols["hi"].append(np.stack([x[1][i] for x, i in zip(per_dim, idx)], axis=1))
        cols["so"].append(np.stack([x[3][i] for x, i in zip(per_dim, idx)], axis=1))
        cols["do"].append(np.broadcast_to(np.array([a for a, _ in box]), (len(idx[0]), len(shape))))
    nd = len(shape)

    def cat(k: str, width: int | None) -> np.ndarray:
        if cols[k]:
            return np.concatenate(cols[k]).astype(np.int64)
        return np.zeros((0,) if width is None else (0, width), np.int64)

    return ClassPlan(
        shape=shape,
        itemsize=itemsize,
        tp_dim=tp_dim,
        src=cat("src", None),
        dst_tp=cat("dst_tp", None),
        lo=cat("lo", nd),
        hi=cat("hi", nd),
        src_origin=cat("so", nd),
        dst_origin=cat("do", nd),
    )


# ---------------------------------------------------------------------------------------------
# The checker
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanReport:
    """What check_plan found: exact coverage, and bytes against the lower bound and the naive baseline."""

    exact: bool
    problems: tuple[str, ...]
    num_transfers: int
    bytes_moved: int  # sum of transfer sizes
    lower_bound: int  # every destination byte received once
    bytes_local: int  # transfers whose source and destination are the same rank (colocated)
    bytes_remote: int  # transfers that cross ranks
    max_rank_send: int  # most bytes any one rank sends to other ranks
    max_rank_recv: int  # most bytes any one rank receives from other ranks
    naive_bytes: int  # gather everything on trainer rank 0, then send the full model to every engine rank
    naive_max_rank_send: int  # what trainer rank 0 sends in the naive scheme

    @property
    def moved_over_lower_bound(self) -> float:
        """1.0 means no byte is sent twice."""
        return self.bytes_moved / self.lower_bound if self.lower_bound else 1.0


def check_plan(plan: TransferPlan, max_problems: int = 20) -> PlanReport:
    """Verify by interval arithmetic that each destination byte is covered exactly once, and count bytes.

    Per class and engine TP rank: every box lies inside its source shard and its destination shard
    (recomputed from the layouts with the scalar box functions, not taken from the planner), and
    the boxes tile the destination box exactly once (coverage counted on the grid of box edges).
    Engines share the template, so with distinct destination ranks this covers every engine rank.
    """
    problems: list[str] = []

    def problem(msg: str) -> None:
        if len(problems) < max_problems:
            problems.append(msg)

    if len(set(plan.src_ranks.tolist())) != plan.src_ranks.size:
        problem("trainer rank ids are not distinct")
    if len(set(plan.dst_ranks.reshape(-1).tolist())) != plan.dst_ranks.size:
        problem("engine rank ids are not distinct")

    checked: dict[int, bool] = {}
    for p, spec in enumerate(plan.params):
        c = plan.class_of[p]
        cls = plan.classes[c]
        if (cls.shape, cls.itemsize, cls.tp_dim) != (spec.shape, spec.dtype.itemsize, plan.tp_dims[p]):
            problem(f"'{spec.name}' is planned with the template of another class")
        elif c not in checked:
            checked[c] = _check_class(plan, cls, spec.name, problem)

    # Bytes: per template row, times the engines and the parameters that share the class on each pipeline rank.
    m_eng, k = plan.engines.engines, plan.engines.tp
    pp, per = plan.trainer.pp, plan.trainer.stage_size
    uses = np.zeros((len(plan.classes), pp), dtype=np.int64)
    np.add.at(uses, (np.asarray(plan.class_of, dtype=np.int64), np.asarray(plan.stages, dtype=np.int64)), 1)
    n_ids = int(max(plan.src_ranks.max(), plan.dst_ranks.max())) + 1
    tp_of_rank = np.full(n_ids, -1, dtype=np.int64)  # engine TP rank hosted by each global rank, -1: none
    tp_of_rank[plan.dst_ranks.reshape(-1)] = np.tile(np.arange(k), m_eng)
    moved = local = 0
    send = np.zeros(plan.trainer.size, dtype=np.int64)  # by trainer mesh index, to other ranks
    recv_by_tp = np.zeros(k, dtype=np.int64)  # into each engine TP rank, including local rows
    local_at = np.zeros(n_ids, dtype=np.int64)  # local bytes by global rank
    for (c, stage), n_params in np.ndenumerate(uses):
        cls = plan.classes[c]
        if n_params == 0 or len(cls) == 0:
            continue
        nb = cls.nbytes * n_params
        src = stage * per + cls.src  # trainer mesh index of each row's source on this pipeline rank
        moved += int(nb.sum()) * m_eng
        np.add.at(send, src, nb * m_eng)
        np.add.at(recv_by_tp, cls.dst_tp, nb)
        # A row is local for at most one engine: the one whose rank (e, dst_tp) is the source's rank.
        g = plan.src_ranks[src]
        is_local = tp_of_rank[g] == cls.dst_tp
        local += int(nb[is_local].sum())
        np.add.at(send, src[is_local], -nb[is_local])
        np.add.at(local_at, g[is_local], nb[is_local])
    lower = m_eng * sum(
        box_numel(plan.dst_box(p, j)) * s.dtype.itemsize for p, s in enumerate(plan.params) for j in range(k)
    )
    max_recv = int((recv_by_tp[None, :] - local_at[plan.dst_ranks]).max())
    total = sum(s.nbytes for s in plan.params)
    root = int(plan.src_ranks[0])
    on_root = sum(box_numel(plan.src_box(p, root)) * s.dtype.itemsize for p, s in enumerate(plan.params))
    bcast_to = sum(1 for r in plan.dst_ranks.reshape(-1) if int(r) != root)
    if moved != lower:
        problem(f"bytes moved {moved} != lower bound {lower}")
    return PlanReport(
        exact=not problems and all(checked.values()),
        problems=tuple(problems),
        num_transfers=len(plan),
        bytes_moved=moved,
        lower_bound=lower,
        bytes_local=local,
        bytes_remote=moved - local,
        max_rank_send=int(send.max(initial=0)),
        max_rank_recv=max_recv,
        naive_bytes=(total - on_root) + total * bcast_to,
        naive_max_rank_send=total * bcast_to,
    )


def _check_class(plan: TransferPlan, cls: ClassPlan, name: str, problem: Callable[[str], None]) -> bool:
    """Exact-once coverage of each engine TP rank's box by one class's template rows."""
    ok = True
    tp_dim, nd = cls.tp_dim, len(cls.shape)
    if np.any(cls.hi <= cls.lo):
        problem(f"'{name}': empty transfer box")
        ok = False
    # Each row inside its source shard, with the right origin (boxes of all trainer shards, recomputed).
    per = plan.trainer.stage_size  # the templates index one pipeline rank's (fsdp, tp) mesh
    if len(cls) and (cls.src.min() < 0 or cls.src.max() >= per):
        problem(f"'{name}': source mesh index out of range")
        return False
    used = np.unique(cls.src)
    boxes = np.zeros((per, nd, 2), dtype=np.int64)
    for m in used:
        boxes[m] = trainer_shard_box(cls.shape, tp_dim, plan.trainer, int(m))
    src_box = boxes[cls.src]  # (T, nd, 2)
    if np.any(cls.lo < src_box[:, :, 0]) or np.any(cls.hi > src_box[:, :, 1]):
        problem(f"'{name}': a transfer reads outside its trainer shard")
        ok = False
    if np.any(cls.src_origin != src_box[:, :, 0]):
        problem(f"'{name}': a transfer has the wrong source origin")
        ok = False
    for j in range(plan.engines.tp):
        box = np.array(engine_shard_box(cls.shape, tp_dim, plan.engines.tp, j), dtype=np.int64).reshape(nd, 2)
        rows = cls.dst_tp == j
        lo, hi = cls.lo[rows], cls.hi[rows]
        if np.any(lo < box[:, 0]) or np.any(hi > box[:, 1]) or np.any(cls.dst_origin[rows] != box[:, 0]):
            problem(f"'{name}': a transfer writes outside engine TP rank {j}'s shard")
            ok = False
            continue
        if np.any(box[:, 1] <= box[:, 0]):
            if rows.any():
                problem(f"'{name}': transfers into the empty shard of engine TP rank {j}")
                ok = False
            continue
        if not _covers_exactly_once(lo, hi, box):
            problem(f"'{name}': engine TP rank {j} is not covered exactly once")
            ok = False
    if np.any((cls.dst_tp < 0) | (cls.dst_tp >= plan.engines.tp)):
        problem(f"'{name}': destination TP rank out of range")
        ok = False
    return ok


def _covers_exactly_once(lo: np.ndarray, hi: np.ndarray, box: np.ndarray) -> bool:
    """Whether boxes (lo, hi: (T, nd)) cover `box` (nd, 2) with multiplicity exactly 1 everywhere.

    Coordinate compression: the edges of all boxes cut each dim into elementary intervals; a
    difference array with +-1 at each box's corners, summed along every axis, gives the number
    of boxes over each elementary cell. Cost grows with the edges, not with the bytes.
    """
    nd = box.shape[0]
    edges = [np.unique(np.concatenate([lo[:, d], hi[:, d], box[d]])) for d in range(nd)]
    counts = np.zeros([len(e) for e in edges], dtype=np.int64)
    lo_i = [np.searchsorted(edges[d], lo[:, d]) for d in range(nd)]
    hi_i = [np.searchsorted(edges[d], hi[:, d]) for d in range(nd)]
    for corner in product((0, 1), repeat=nd):
        sign = (-1) ** sum(corner)
        index = tuple(hi_i[d] if c else lo_i[d] for d, c in enumerate(corner))
        np.add.at(counts, index, sign)
    for d in range(nd):
        counts = np.cumsum(counts, axis=d)
    inside = tuple(
        slice(np.searchsorted(edges[d], box[d, 0]), np.searchsorted(edges[d], box[d, 1])) for d in range(nd)
    )
    return bool(np.all(counts[inside] == 1))
