"""Parallelism for the trainer: a process group, a device mesh, tensor parallelism and FSDP2 on an HF model.

The trainer's ranks are global ranks 0..n-1 of a torch.distributed world (gloo on CPU, NCCL for CUDA
tensors plus gloo for CPU ones on GPU machines). On the ray backend the world is the trainer ranks alone:
the rollout engines receive weights over a group of their own (distributed.weight_sync.SyncGroup), so they can
die, join or leave without touching the trainer's groups. Every rank of the world builds the same mesh.

FSDP2 is set to *sum* gradients over ranks (not average): each rank back-propagates its share of the
global loss, with shares taken over global denominators (`PolicyTrainer`), so the summed gradient is
the gradient of the whole batch and N ranks make the same update as one.

Tensor parallelism (torchtitan style: applied by `apply_tp`, not written into the model) splits the
decoder layers' linear layers over the "tp" dim of a (dp, tp) mesh, following the model's own HF TP
plan (colwise / rowwise). TP ranks see the same rows, so data-parallel sums (loss denominators,
FSDP2's gradient reduce-scatter) run over the "dp" dim only. Embeddings, norms and the (tied) head
stay whole on every TP rank: a tied vocab-parallel head would need the vocab to divide by tp, and
they are a small share of the weights.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache

# the HF TP plan styles applied inside the decoder layers
TP_STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


# rank 0's rendezvous stores, held from `open_rendezvous` until its `init_distributed` takes them
_held_stores: dict[str, dist.TCPStore] = {}


def open_rendezvous(host: str, timeout_s: float) -> str:
    """Host a world's TCP store on a port the OS picks and return its tcp:// address. The port is bound from
    here on, so nothing can take it between choosing and joining (a port probed free and released can be)."""
    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    address = f"tcp://{host}:{store.port}"
    _held_stores[address] = store
    return address


def _store(init_method: str, timeout_s: float) -> dist.Store:
    """The store at `init_method`: the one this process hosts (open_rendezvous), else a client of it."""
    held = _held_stores.pop(init_method, None)
    if held is not None:
        return held
    match = re.fullmatch(r"tcp://(.+):(\d+)", init_method)
    if match is None:
        raise ValueError(f"rendezvous address {init_method!r} is not tcp://HOST:PORT")
    return dist.TCPStore(
        match[1], int(match[2]), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def init_distributed(init_method: str, rank: int, world_size: int, timeout_s: float) -> torch.device:
    """Join the world whose store is at `init_method` (tcp://host:port, hosted by `open_rendezvous`); return this
    rank's device (cuda if it has one)."""
    if init_method.startswith("tcp://127.0.0.1:"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's sockets on loopback
    if torch.cuda.is_available():
        # NCCL for the model's collectives, gloo for CPU tensors (weight-sync staging buffers, counts)
        backend, device = "cpu:gloo,cuda:nccl", torch.device("cuda", torch.cuda.current_device())
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(
        backend,
        store=_store(init_method, timeout_s),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return device


def trainer_mesh(num_ranks: int, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D mesh over global ranks 0..num_ranks-1; every rank of the world must call this (it makes a group)."""
    if num_ranks > dist.get_world_size():
        raise ValueError(f"trainer mesh of {num_ranks} ranks in a world of {dist.get_world_size()}")
    return DeviceMesh(device_type, torch.arange(num_ranks))


def checkpoint_group(num_ranks: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of global ranks 0..num_ranks-1 for DCP's collectives: an async save runs them in a thread
    beside training's own, which must not share their group."""
    return dist.new_group(
        list(range(num_ranks)),
        backend="gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        use_local_synchronization=True,
    )


def join_sharded_world(
    init_method: str, rank: int, num_ranks: int, timeout_s: float
) -> tuple[DeviceMesh, dist.ProcessGroup]:
    """Join a world of FSDP2 ranks only (a critic's or a reference's): its 1-D mesh and its checkpoint group."""
    device = init_distributed(init_method, rank, num_ranks, timeout_s)
    return trainer_mesh(num_ranks, device.type), checkpoint_group(num_ranks, timeout_s)


def dp_tp_mesh(num_ranks: int, tp: int, device_type: str = "cpu") -> DeviceMesh:
    """A 2-D ("dp", "tp") mesh over global ranks 0..num_ranks-1, tp innermost (TP ranks are neighbours).

    Rank `i * tp + j` is data-parallel rank i, TP rank j (as the weight-sync planner's TrainerLayout).
    Every rank of the world must call this (it makes the groups of both dims).
    """
    if tp < 1 or num_ranks % tp:
        raise ValueError(f"trainer_tp={tp} must be positive and divide the {num_ranks} trainer ranks")
    if num_ranks > dist.get_world_size():
        raise ValueError(f"trainer mesh of {num_ranks} ranks in a world of {dist.get_world_size()}")
    grid = torch.arange(num_ranks).reshape(num_ranks // tp, tp)
    return DeviceMesh(device_type, grid, mesh_dim_names=("dp", "tp"))


def replica_mesh(
    num_ranks: int, tp: int, replicas: int, device_type: str = "cpu"
) -> tuple[DeviceMesh, DeviceMesh]:
    """HSDP: a ("rep", "shard", "tp") mesh of `replicas` copies of the sharded model, and its data-parallel ranks
    (rep x shard, flattened) as a 1-D mesh. Rank `(r * shards + i) * tp + j` is replica r, FSDP rank i, TP rank j:
    replica 0 is the ranks a `dp_tp_mesh` of num_ranks / replicas would hold. Every rank of the world calls this."""
    if replicas < 1 or num_ranks % (replicas * tp):
        raise ValueError(
            f"trainer_replicas={replicas} * trainer_tp={tp} must divide the {num_ranks} trainer ranks"
        )
    grid = torch.arange(num_ranks).reshape(replicas, num_ranks // (replicas * tp), tp)
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=("rep", "shard", "tp"))
    return mesh, mesh["rep", "shard"]._flatten("dp")  # kept: slicing "dp" from the root is going away


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    # HF models name their decoder layer class in _no_split_modules (e.g. Qwen2DecoderLayer)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    # by the class's MRO: under FSDP2 a Qwen2DecoderLayer is an FSDPQwen2DecoderLayer (a subclass)
    layers = [
        (n, m) for n, m in model.named_modules() if any(c.__name__ in layer_classes for c in type(m).__mro__)
    ]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules to shard")
    return layers


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Module name -> HF TP style ("colwise"/"rowwise") of every linear layer that `apply_tp` splits.

    Read from the model's own plan (`model._tp_plan`, e.g. Qwen2's); entries outside the decoder layers
    (embeddings, head) are left whole. Raises ValueError if the model has no plan or an unsupported style.
    """
    declared = dict(getattr(model, "_tp_plan", None) or {})
    name = type(model).__name__
    if not declared:
        raise ValueError(f"{name} declares no tensor-parallel plan (_tp_plan); train it with trainer_tp=1")
    patterns = [(re.compile(re.escape(p).replace(r"\*", r"\d+")), style) for p, style in declared.items()]
    inside = tuple(f"{n}." for n, _ in _decoder_layers(model))
    plan = {}
    for module_name, module in model.named_modules():
        style = next((st for pat, st in patterns if pat.fullmatch(module_name)), None)
        if style is None or not module_name.startswith(inside):
            continue  # not in the plan, or outside the decoder layers: replicated on every TP rank
        if style not in TP_STYLES or not isinstance(module, nn.Linear):
            raise ValueError(
                f"{name}'s TP plan has style '{style}' on {module_name} ({type(module).__name__}); "
                f"only {sorted(TP_STYLES)} on nn.Linear are supported: train it with trainer_tp=1"
            )
        plan[module_name] = style
    return plan


def tp_param_dims(model: nn.Module) -> dict[str, int | None]:
    """Parameter name -> the dim `apply_tp` splits it on (None = whole on every TP rank).

    The weight-sync planner's TP rule for this trainer (resharding.TpRule); a pure function of the
    unsharded model, so engine ranks can derive it too.
    """
    plan = tp_plan(model)
    dims: dict[str, int | None] = {}
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        style = plan.get(module)
        if style == "colwise":
            dims[name] = 0  # weight and bias split by output features
        elif style == "rowwise" and leaf == "weight":
            dims[name] = 1  # split by input features; a rowwise bias is added after the all-reduce: whole
        else:
            dims[name] = None
    return dims


def check_tp(model: nn.Module, tp: int, plan: Mapping[str, str] | None = None) -> None:
    """Raise ValueError unless `model` can be split over `tp` ranks; needs no process group.

    The model must have a TP plan (`tp_plan`), and its attention heads, KV heads and every split
    feature dim must divide by tp: a clear error up front, not a reshape failure in the forward.
    """
    if tp < 1:
        raise ValueError(f"trainer_tp must be positive, got {tp}")
    plan = tp_plan(model) if plan is None else plan
    name = type(model).__name__
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(f"trainer_tp={tp} does not divide {field}={value} of {name}")
    modules = dict(model.named_modules())
    for module_name, style in plan.items():
        linear = modules[module_name]
        assert isinstance(linear, nn.Linear)
        size = linear.out_features if style == "colwise" else linear.in_features
        if size % tp:
            raise ValueError(
                f"trainer_tp={tp} does not divide the {size} features that {module_name} of {name} "
                f"splits ({style})"
            )


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Recompute decoder layers in backward instead of keeping their activations (training.activation_checkpointing):
    none; full: every layer; selective: every other layer (the odd-numbered ones, 1, 3, ...), half the saving for
    half the recompute. In place: each layer's forward is wrapped, its module and parameter names unchanged (FSDP2,
    TP plans, checkpoints and the weight sync see the same model). Apply before FSDP2, as torchtitan does."""
    if mode == "none":
        return model
    for i, (_, layer) in enumerate(_decoder_layers(model)):
        if mode == "full" or i % 2 == 1:
            layer.forward = functools.partial(_recomputed, layer.forward)
    return model


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # a forward that fills a KV cache (generation) runs as it is: a recompute would fill it again. The shared
    # prompt's caches (training.prefix) are recomputable: a layer computes the same from them every time
    with_cache = any(
        isinstance(v, Cache) and not getattr(v, "recomputable", False) for v in (*args, *kwargs.values())
    )
    if with_cache or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Tensor parallelism over the 1-D `tp_mesh`: the decoder layers' linear layers per the model's TP plan.

    Colwise layers (q/k/v, gate/up) split output features, so each TP rank runs heads/num_tp of the
    attention heads on plain local tensors; rowwise layers (o/down) split input features and all-reduce
    their output. Everything else stays whole. Raises ValueError when the model has no TP plan or its
    sizes do not divide by the mesh size.
    """
    plan = tp_plan(model)
    check_tp(model, tp_mesh.size(), plan)
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {n: TP_STYLES[style]() for n, style in plan.items()})
    return model


def parallelize(
    model: nn.Module, mesh: DeviceMesh, mixed_precision: str = "none", ep: bool = False
) -> nn.Module:
    """TP over mesh["tp"] (when it has more than one rank), then FSDP2 over mesh["dp"] (a `dp_tp_mesh`), or HSDP
    over mesh["rep", "shard"] (a `replica_mesh`: shards within a replica, gradients summed across replicas).
    ep: an MoE model's experts split over mesh["dp"] first (runtime.trainer_ep), which FSDP2 then leaves alone."""
    from loopline.training.expert_parallel import apply_ep

    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    experts = apply_ep(model, mesh["dp"]) if ep else None
    names = mesh.mesh_dim_names or ()
    return shard_model(
        model, mesh["rep", "shard"] if "rep" in names else mesh["dp"], mixed_precision, experts
    )


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    mixed_precision: str = "none",
    ignored: set[nn.Parameter] | None = None,
) -> nn.Module:
    """FSDP2: `fully_shard` each decoder layer, then the root (embeddings, final norm, tied head); sum gradients.

    `mesh` is 1-D: the data-parallel ranks (`mesh["dp"]` of a `dp_tp_mesh` after `apply_tp`), or 2-D (replicate,
    shard) for HSDP. mixed_precision (training.mixed_precision): bf16 gathers bfloat16 parameters for compute and
    reduces float32 gradients into the float32 shards (training.precision.fsdp_policy). ignored: parameters FSDP2
    leaves alone (the experts apply_ep split).
    """
    from loopline.training.precision import fsdp_policy

    policy = fsdp_policy(mixed_precision)
    for _, layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # sum, no division: each rank's loss is already its share of the total (and gloo has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of `values` over the ranks of `group` (a copy); `values` unchanged when there is no group."""
    out = values.detach().clone()
    if group is not None:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def mesh_groups(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by DeviceMesh (plain tensors together), in first-seen order.

    Under TP + FSDP2 the split layers' DTensors live on the (dp, tp) mesh and the others on the dp
    mesh; torch's foreach kernels (AdamW, clipping) refuse to mix meshes in one call.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm of `max_norm`; return the norm before clipping (a plain tensor).

    torch.nn.utils.clip_grad_norm_ per mesh group, combined: each group's norm is reduced over its own
    mesh (a sharded piece counted once, a TP-replicated one once), then the groups' norms are summed
    in quadrature. One group (no TP) is exactly torch's clip_grad_norm_.
    """
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params)
    clip_grads_with_norm(params, max_norm, total)
    return total


def total_grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients (a plain tensor): each mesh group's norm reduced over its
    own mesh (a sharded piece counted once, a TP-replicated one once), the groups' norms summed in quadrature."""
    norms = []
    for group in mesh_groups(p for p in parameters if p.grad is not None):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_grads_with_norm(parameters: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale the parameters' gradients by max_norm / total when total exceeds max_norm (per mesh group)."""
    for group in mesh_groups(p for p in parameters if p.grad is not None):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def _options(sharded: bool) -> StateDictOptions:
    # full tensors, gathered to rank 0's CPU when sharded (the other ranks get an empty dict)
    return StateDictOptions(full_state_dict=True, cpu_offload=sharded)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is under FSDP2."""
    return isinstance(model, FSDPModule)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights by name, on CPU on rank 0 (empty on other ranks); a collective when sharded."""
    return get_model_state_dict(model, options=_options(is_sharded(model)))  # type: ignore[return-value]


def load_full_model_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load whole weights (every rank passes the same dict); each rank keeps its own shards."""
    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Optimizer state keyed by parameter name, whole tensors: on rank 0 (empty elsewhere) when sharded."""
    return get_optimizer_state_dict(model, optimizer, options=_options(is_sharded(model)))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a `full_optimizer_state` (every rank passes the same dict); each rank keeps its own shards."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
