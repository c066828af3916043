"""Data parallelism for the trainer: a process group, a 1-D device mesh, FSDP2 applied to an HF model.

The trainer's ranks are global ranks 0..n-1 of a torch.distributed world (gloo on CPU, NCCL for CUDA
tensors plus gloo for CPU ones on GPU machines). The world may hold more ranks than the trainer, e.g.
the rollout engines that receive weights from it; every rank of the world builds the same mesh.

FSDP2 is set to *sum* gradients over ranks (not average): each rank back-propagates its share of the
global loss, with shares taken over global denominators (`PolicyTrainer`), so the summed gradient is
the gradient of the whole batch and N ranks make the same update as one.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping

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


def init_distributed(init_method: str, rank: int, world_size: int, timeout_s: float) -> torch.device:
    """Join the world at `init_method` (e.g. tcp://host:port); return this rank's device (cuda if it has one)."""
    if init_method.startswith("tcp://127.0.0.1:"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's sockets on loopback
    if torch.cuda.is_available():
        # NCCL for the model's collectives, gloo for CPU tensors (weight-sync staging buffers, counts)
        backend, device = "cpu:gloo,cuda:nccl", torch.device("cuda", torch.cuda.current_device())
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=init_method,
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


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2: `fully_shard` each decoder layer, then the root (embeddings, final norm, tied head); sum gradients."""
    # HF models name their decoder layer class in _no_split_modules (e.g. Qwen2DecoderLayer)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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


def _options(sharded: bool) -> StateDictOptions:
    # full tensors, gathered to rank 0's CPU when sharded (the other ranks get an empty dict)
    return StateDictOptions(full_state_dict=True, cpu_offload=sharded)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is under FSDP2."""
    return isinstance(model, FSDPModule)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights by name, on CPU on rank 0 (empty on other ranks); a collective when sharded."""
    return get_model_state_dict(model, options=_options(is_sharded(model)))


def load_full_model_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load whole weights (every rank passes the same dict); each rank keeps its own shards."""
    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Optimizer state keyed by parameter name, whole tensors: on rank 0 (empty elsewhere) when sharded."""
    return get_optimizer_state_dict(model, optimizer, options=_options(is_sharded(model)))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a `full_optimizer_state` (every rank passes the same dict); each rank keeps its own shards."""
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
