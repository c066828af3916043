"""Expert parallelism (runtime.trainer_ep): each MoE layer's experts split over the data-parallel ranks, every
token sent to the ranks of its top-k experts and back with all_to_all.

The experts' 3-D weights become DTensors sharded on the expert dimension over the data-parallel mesh: the layout
FSDP2 gives any parameter (contiguous blocks of experts / ranks), so checkpoints (DCP, resumable at another rank
count), the grad norm and the weight sync read them as they read FSDP2's shards. What differs is what moves:
FSDP2 gathers every expert on every rank for each forward; here the experts stay where they are and the tokens
travel. FSDP2 shards the rest of the model and leaves the experts alone (shard_model's `ignored`); an expert's
gradient needs no reduction, since its rank received every rank's tokens for it.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

# (E, 2I, H) and (E, H, I) in Qwen3-MoE's and Mixtral's experts
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The MoE layers' experts: modules holding every expert's weights as 3-D tensors, one row per expert."""
    return [
        m
        for m in model.modules()
        if all(
            isinstance(getattr(m, w, None), nn.Parameter) and getattr(m, w).dim() == 3 for w in EXPERT_WEIGHTS
        )
        and hasattr(m, "num_experts")
    ]


def check_ep(model: nn.Module, ranks: int) -> None:
    """Raise ValueError naming runtime.trainer_ep when `model` has no experts or `ranks` does not divide them."""
    experts: list[Any] = expert_modules(model)  # transformers' experts modules (num_experts, act_fn, ...)
    if not experts:
        raise ValueError(
            f"runtime.trainer_ep={ranks}: {type(model).__name__} is not a mixture of experts (no experts to split)"
        )
    if experts[0].num_experts % ranks:
        raise ValueError(
            f"runtime.trainer_ep={ranks} must divide the model's {experts[0].num_experts} experts per layer"
        )


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Split every MoE layer's experts over the 1-D `mesh` (in place) and route tokens to them with all_to_all;
    returns the experts' parameters (for FSDP2 to leave alone). Every rank must start from the same weights."""
    check_ep(model, mesh.size())
    experts: list[Any] = expert_modules(model)
    for module in experts:
        for name in EXPERT_WEIGHTS:
            weight = getattr(module, name)
            sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)])
            setattr(module, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        module.ep_group = mesh.get_group()
        module.forward = MethodType(_ep_forward, module)
    return {getattr(m, name) for m in experts for name in EXPERT_WEIGHTS}


def _ep_forward(
    self: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output (N, H) for this rank's N tokens: each (token, chosen expert) pair goes to the expert's
    rank, through that expert's MLP, comes back, and is summed into its token with its routing weight."""
    group = self.ep_group
    ranks = dist.get_world_size(group)
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()  # (E / ranks, ...)
    per_rank = gate_up.shape[0]
    k = top_k_index.shape[1]
    expert = top_k_index.reshape(-1)  # (N * k,)
    order = torch.argsort(expert, stable=True)  # pairs by expert, so by the rank that holds it
    token, expert = order // k, expert[order]
    send = torch.bincount(expert // per_rank, minlength=ranks)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    rows = _exchange(hidden[token], recv_sizes, send_sizes, group)  # (pairs this rank computes, H)
    local = torch.empty(sum(recv_sizes), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(local, expert % per_rank, recv_sizes, send_sizes, group=group)
    out = _local_experts(rows, local, gate_up, down, self.act_fn)
    back = _exchange(out, send_sizes, recv_sizes, group)  # (N * k, H), in `order`
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(hidden).index_add(0, token, (back * weights).to(hidden.dtype))


_GROUPED_MM = getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _local_experts(
    rows: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Any
) -> torch.Tensor:
    """Each row through its expert's MLP (down(act(gate) * up)), `expert` indexing this rank's experts: one
    grouped matrix product per projection over the rows sorted by expert where torch has one, else expert by
    expert."""
    if not len(rows):  # no token came: still a (zero) gradient for every expert, as on the other ranks, whose
        # grad-norm collectives this rank must join
        return rows.new_zeros((0, down.shape[1])) + 0.0 * (gate_up.sum() + down.sum())
    if _GROUPED_MM is None or any(d % 8 for d in (*gate_up.shape[1:], down.shape[1])):  # its 16-byte strides
        out = torch.zeros((len(rows), down.shape[1]), dtype=rows.dtype, device=rows.device)
        for e in range(gate_up.shape[0]):
            at = (expert == e).nonzero().squeeze(-1)
            if len(at):
                gate, up = nn.functional.linear(rows[at], gate_up[e]).chunk(2, dim=-1)
                out = out.index_add(0, at, nn.functional.linear(act(gate) * up, down[e]))
        return out
    order = torch.argsort(expert, stable=True)
    ends = torch.cumsum(torch.bincount(expert, minlength=gate_up.shape[0]), 0).to(torch.int32)
    gate, up = _GROUPED_MM(rows[order], gate_up.transpose(-2, -1), offs=ends).chunk(2, dim=-1)
    out = _GROUPED_MM(act(gate) * up, down.transpose(-2, -1), offs=ends)
    return out[torch.argsort(order)]  # back in the rows' order


def _exchange(rows: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group: Any) -> torch.Tensor:
    """all_to_all of `rows` (send_sizes rows to each rank, recv_sizes from each), with its gradient sent back."""
    return _AllToAll.apply(rows, recv_sizes, send_sizes, group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse exchange of the gradient."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group: Any
    ) -> torch.Tensor:
        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        out = rows.new_empty((sum(recv_sizes), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        recv_sizes, send_sizes = ctx.sizes
        out = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_sizes, recv_sizes, group=ctx.group)
        return out, None, None, None
