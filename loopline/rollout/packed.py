"""Decoding on a CPU with the linear layers' weights reordered for oneDNN, for the length of one generate call.

A decode step multiplies a few rows (the sequences in flight) by every weight matrix. On a CPU the default fp32
kernel for so few rows runs far below the machine's peak; oneDNN's kernel on a weight reordered into its own
blocked layout ran 1.7-2.3x faster here at 16 rows (and faster at 64 and 512 rows), the same products up to float
rounding. The reordered copies cost one more copy of the linear weights while a call generates, and are dropped
when it returns, so the weights an engine shares with a local actor are packed again, as they are then, at the
next call; a call that takes new weights mid-way packs them again (`pack`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _ops_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and all(
            hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):  # a torch build without oneDNN's CPU ops
        return False


def packable(module: nn.Module) -> bool:
    """A plain nn.Linear on the CPU in float32, with no hooks and no forward of its own that packing would skip."""
    return (
        type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
        and not module._forward_hooks
        and not module._forward_pre_hooks
        and "forward" not in module.__dict__
    )


def _packed_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: int
) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out)


class PackedLinears:
    """While open, each packable linear layer of `model` multiplies by a reordered copy of its weight; `rows` is
    oneDNN's hint of how many rows a product has. Closing restores the layers' own forward and frees the copies."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.rows = rows
        self.layers = [m for m in model.modules() if packable(m)] if _ops_available() else []

    def pack(self) -> None:
        """Reorder the layers' weights as they are now (again after new weights were loaded)."""
        with torch.no_grad():
            for m in self.layers:
                weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), self.rows)
                bias = None if m.bias is None else m.bias.detach()
                m.forward = functools.partial(_packed_forward, weight=weight, bias=bias, out=m.out_features)

    def close(self) -> None:
        for m in self.layers:
            m.__dict__.pop("forward", None)

    def __enter__(self) -> PackedLinears:
        try:
            self.pack()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
