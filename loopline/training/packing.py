"""Packed forwards (model.packing): a padded batch's real tokens laid end to end in a few rows, so that no
compute goes to padding.

Each sequence keeps its own position ids (0, 1, ...) and the model is called without an attention mask: Hugging
Face models then read the resets of `position_ids` as sequence boundaries and attend within each sequence only
(transformers' packed-sequence masks), which is what the padded forward computes for the real tokens. A model
that does not (another architecture, an older transformers) is caught by a check on its first packed forward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loopline.training.replay import engine_routes


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded (B, L) batch sit in packed rows (R, W); sequences are never split."""

    input_ids: torch.Tensor  # (R, W) long, padding at the end of a row
    position_ids: torch.Tensor  # (R, W) long, from 0 in every sequence (and in a row's padding)
    slot: torch.Tensor  # (B, L) long: flat index into (R * W) of each padded-batch token, -1 on padding

    def unpack(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Values (R, W, ...) per packed token laid back out as (B, L, ...), `fill` on padding."""
        out = packed.new_full((*self.slot.shape, *packed.shape[2:]), fill)
        real = self.slot >= 0
        out[real] = packed.flatten(0, 1)[self.slot[real]]
        return out

    def lay_in(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """Values (B, L, ...) per padded-batch token laid out as the packed rows (R, W, ...), `fill` on their padding
        (unpack's inverse)."""
        rows, width = self.input_ids.shape
        out = values.new_full((rows * width, *values.shape[2:]), fill)
        real = self.slot >= 0
        out[self.slot[real]] = values[real]
        return out.view(rows, width, *values.shape[2:])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int = 0) -> Packing:
    """Pack the rows' real tokens (attention_mask 1, kept in order) first-fit decreasing into rows as wide as the
    longest sequence: the width a padded row needs anyway, so attention never spans more than it did."""
    device = input_ids.device
    lengths = attention_mask.sum(dim=1).tolist()
    width = max(1, max(lengths, default=1))
    fill: list[int] = []  # tokens used in each packed row
    start = [0] * len(lengths)  # each sequence's first flat index in the packed rows
    for seq in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, used in enumerate(fill) if used + lengths[seq] <= width), len(fill))
        if row == len(fill):
            fill.append(0)
        start[seq] = row * width + fill[row]
        fill[row] += lengths[seq]
    real = attention_mask.bool()
    offset = attention_mask.cumsum(dim=1) - 1  # a real token's place in its sequence
    slot = torch.where(real, torch.tensor(start, device=device).unsqueeze(1) + offset, -1)
    rows = max(1, len(fill))
    ids = input_ids.new_full((rows * width,), pad_id)
    ids[slot[real]] = input_ids[real]
    # a row's padding counts from 0 like a sequence of its own, so it never joins the sequence before it
    cols = torch.arange(width, device=device).expand(rows, width)
    used = torch.tensor(fill or [0], device=device).unsqueeze(1)
    positions = torch.where(cols < used, 0, cols - used).flatten()
    positions[slot[real]] = offset[real]
    return Packing(ids.view(rows, width), positions.view(rows, width), slot)


_checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def packed_forward(model: nn.Module, packing: Packing, routes: torch.Tensor | None = None) -> Any:
    """The model's output over the packed rows (logits or hidden states per packed token, as the model gives).
    routes: the padded batch's engine routes (TokenBatch.routes), packed for the forward (training.replay)."""
    if model not in _checked:
        _check_separates_sequences(model)
        _checked.add(model)
    with engine_routes(model, packing.lay_in(routes, -1) if routes is not None else None):
        return model(input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False)


def _check_separates_sequences(model: nn.Module) -> None:
    """Raise if `model` lets packed sequences attend to each other: one sequence packed after another must give
    what it gives alone. Run by every rank of a sharded model at the same point (its first packed forward)."""
    device = next(model.parameters()).device
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]], device=device)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
    training = model.training
    model.eval()
    with torch.no_grad():
        both = model(input_ids=ids, position_ids=positions, use_cache=False)[0][0, 3:].float()
        alone = model(input_ids=ids[:, 3:], position_ids=positions[:, 3:], use_cache=False)[0][0].float()
    model.train(training)
    scale = 1.0 + float(alone.abs().max())
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 3e-2
    if float((both - alone).abs().max()) > tolerance * scale:
        raise ValueError(
            f"model.packing: {type(model).__name__} attends across packed sequences (its attention does not "
            "read position-id resets as sequence boundaries; transformers >= 4.56 models do with sdpa, eager "
            "or flash attention); set model.packing=false"
        )
