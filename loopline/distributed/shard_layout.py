"""Where each byte of a parameter lives: trainer layouts (FSDP2 x TP), engine layouts (replicas x TP), and the
shard boxes they give, plus parameter lists of known models. Pure: no tensors, no processes.

Coordinates: every shard is a box in its parameter's global index space, one `[lo, hi)` per dim. The transfer
planner (`resharding`) maps trainer boxes onto engine boxes; its checker and the executors in `weight_sync`
recompute boxes with the scalar functions here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

Box = tuple[tuple[int, int], ...]
"""A shard's region of a parameter: one half-open `(lo, hi)` interval per dimension."""

TpRule = Callable[[str, tuple[int, ...]], "int | None"] | Mapping[str, "int | None"]
"""Which dimension a parameter is split on under tensor parallelism (None = replicated)."""


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the planner sees it: name, full (unsharded) shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the full parameter."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TrainerLayout:
    """Trainer ranks as a (pp, fsdp, tp) mesh, tp innermost: mesh index `(s * fsdp + i) * tp + j` is pipeline
    stage rank s, FSDP rank i, TP rank j.

    A parameter lives on one pipeline rank (`stage_of`). There, TP splits it on its TP dim first (torch chunk
    rule), then FSDP2's `fully_shard` splits dim 0 of that TP-local tensor into `fsdp` chunks of ceil(d0 / fsdp)
    rows; trailing ranks may get fewer rows or none. `ranks` are the global ranks of the mesh indices (default
    `0 .. pp*fsdp*tp - 1`). `layer_stages` (pp > 1): the pipeline rank of each decoder layer.
    """

    fsdp: int
    tp: int = 1
    ranks: tuple[int, ...] | None = None
    pp: int = 1
    layer_stages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ValueError(f"trainer layout needs a positive pp, got {self.pp}")
        if self.pp > 1 and not self.layer_stages:
            raise ValueError(
                "a pipelined trainer layout (pp > 1) needs layer_stages: the stage of each layer"
            )
        if any(not 0 <= s < self.pp for s in self.layer_stages):
            raise ValueError(f"layer_stages {self.layer_stages} name stages outside 0..{self.pp - 1}")
        _check_layout("trainer", self.fsdp, self.tp, self.ranks, self.pp)

    @property
    def size(self) -> int:
        """Number of trainer ranks."""
        return self.pp * self.fsdp * self.tp

    @property
    def stage_size(self) -> int:
        """Trainer ranks per pipeline stage rank: its (fsdp, tp) mesh."""
        return self.fsdp * self.tp

    def stage_of(self, name: str) -> int:
        """The pipeline rank that holds parameter `name` (Llama/Qwen names, as training.pipeline splits them):
        a decoder layer's from layer_stages, the input embeddings on the first, the rest (norm, head) on the last."""
        if self.pp == 1:
            return 0
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            return self.layer_stages[int(parts[2])]
        return 0 if parts[:2] == ["model", "embed_tokens"] else self.pp - 1

    def global_ranks(self) -> np.ndarray:
        """Global rank of each mesh index, shape (fsdp * tp,)."""
        return np.arange(self.size) if self.ranks is None else np.asarray(self.ranks, dtype=np.int64)


@dataclass(frozen=True)
class EngineLayout:
    """`engines` full replicas of the model, each split over `tp` ranks along each parameter's TP dim.

    Replicated parameters (TP dim None) are whole on every rank of an engine. `ranks` are the
    global ranks of (engine e, TP rank j) at index `e * tp + j`; the default places the engines
    right after the trainer's ranks (not colocated). Pass the trainer's ranks to colocate.
    """

    engines: int
    tp: int = 1
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_layout("engine", self.engines, self.tp, self.ranks)

    @property
    def size(self) -> int:
        """Number of engine ranks."""
        return self.engines * self.tp

    def global_ranks(self, first: int) -> np.ndarray:
        """Global rank of each (engine, TP rank), shape (engines, tp); `first` is used when ranks is None."""
        flat = first + np.arange(self.size) if self.ranks is None else np.asarray(self.ranks, dtype=np.int64)
        return flat.reshape(self.engines, self.tp)


def _check_layout(what: str, groups: int, tp: int, ranks: tuple[int, ...] | None, pp: int = 1) -> None:
    if groups < 1 or tp < 1:
        raise ValueError(f"{what} layout needs positive sizes, got {groups} x tp={tp}")
    if ranks is not None:
        if len(ranks) != pp * groups * tp:
            raise ValueError(
                f"{what} layout has {pp * groups * tp} ranks but {len(ranks)} rank ids were given"
            )
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ValueError(f"{what} layout rank ids must be distinct and non-negative")


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")


def default_tp_dim(name: str, shape: tuple[int, ...]) -> int | None:
    """Megatron-style rule for Llama/Qwen names: column-parallel on dim 0, row-parallel weights on dim 1."""
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if module in COLUMN_PARALLEL:
        return 0  # weight and bias are split by output features (embeddings: by vocab)
    if module in ROW_PARALLEL and leaf == "weight" and len(shape) == 2:
        return 1  # split by input features; a row-parallel bias is added after the reduce: replicated
    return None


def resolve_tp_dim(rule: TpRule, spec: ParamSpec) -> int | None:
    """The TP dim of one parameter under `rule` (a dict misses = replicated), validated against its shape."""
    dim = rule.get(spec.name) if isinstance(rule, Mapping) else rule(spec.name, spec.shape)
    if dim is not None and not 0 <= dim < len(spec.shape):
        raise ValueError(f"TP dim {dim} of '{spec.name}' is out of range for shape {spec.shape}")
    return dim


# ---------------------------------------------------------------------------------------------
# Shard boxes (scalar, the reference the checker and the executors use)
# ---------------------------------------------------------------------------------------------


def chunk_bounds(size: int, parts: int) -> np.ndarray:
    """Bounds of torch.chunk-style chunks padded to `parts`: chunk c is [b[c], b[c+1]), trailing ones may be empty."""
    step = -(-size // parts)  # ceil: torch.chunk and FSDP2 give every rank ceil(size/parts) until it runs out
    return np.minimum(np.arange(parts + 1, dtype=np.int64) * step, size)


def trainer_shard_box(shape: tuple[int, ...], tp_dim: int | None, layout: TrainerLayout, index: int) -> Box:
    """The region of a parameter held by index `index` (FSDP rank i, TP rank j) of the (fsdp, tp) mesh of the
    pipeline rank that holds it (the whole mesh when pp = 1)."""
    i, j = divmod(index, layout.tp)
    box = [(0, s) for s in shape]
    if tp_dim is not None and layout.tp > 1:
        b = chunk_bounds(shape[tp_dim], layout.tp)
        box[tp_dim] = (int(b[j]), int(b[j + 1]))
    lo0, hi0 = box[0]
    f = chunk_bounds(hi0 - lo0, layout.fsdp)
    box[0] = (lo0 + int(f[i]), lo0 + int(f[i + 1]))
    return tuple(box)


def engine_shard_box(shape: tuple[int, ...], tp_dim: int | None, tp: int, j: int) -> Box:
    """The region of a parameter held by TP rank `j` of an engine (whole if replicated)."""
    box = [(0, s) for s in shape]
    if tp_dim is not None and tp > 1:
        b = chunk_bounds(shape[tp_dim], tp)
        box[tp_dim] = (int(b[j]), int(b[j + 1]))
    return tuple(box)


def box_numel(box: Box) -> int:
    """Elements in a box (0 if any side is empty)."""
    return math.prod(max(hi - lo, 0) for lo, hi in box)


# ---------------------------------------------------------------------------------------------
# Parameter lists of known models
# ---------------------------------------------------------------------------------------------


def llama_specs(
    layers: int = 80,
    hidden: int = 8192,
    intermediate: int = 28672,
    heads: int = 64,
    kv_heads: int = 8,
    vocab: int = 128256,
    dtype: torch.dtype = torch.bfloat16,
) -> list[ParamSpec]:
    """Parameter list of a Llama-architecture model without building it (defaults: Llama-3-70B)."""
    kv = hidden // heads * kv_heads
    specs = [ParamSpec("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for i in range(layers):
        pre = f"model.layers.{i}."
        specs += [
            ParamSpec(pre + "self_attn.q_proj.weight", (hidden, hidden), dtype),
            ParamSpec(pre + "self_attn.k_proj.weight", (kv, hidden), dtype),
            ParamSpec(pre + "self_attn.v_proj.weight", (kv, hidden), dtype),
            ParamSpec(pre + "self_attn.o_proj.weight", (hidden, hidden), dtype),
            ParamSpec(pre + "mlp.gate_proj.weight", (intermediate, hidden), dtype),
            ParamSpec(pre + "mlp.up_proj.weight", (intermediate, hidden), dtype),
            ParamSpec(pre + "mlp.down_proj.weight", (hidden, intermediate), dtype),
            ParamSpec(pre + "input_layernorm.weight", (hidden,), dtype),
            ParamSpec(pre + "post_attention_layernorm.weight", (hidden,), dtype),
        ]
    specs += [
        ParamSpec("model.norm.weight", (hidden,), dtype),
        ParamSpec("lm_head.weight", (vocab, hidden), dtype),
    ]
    return specs
