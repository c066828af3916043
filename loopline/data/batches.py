"""Typed batches that cross stage boundaries (tokens, masks, log-probs, advantages).

Every batch is a dataclass of row-major tensors (dim 0 = rows): `apply` maps a function over its tensor fields,
and `select`, `split` and `to` are built on it, so no caller walks a batch's fields by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Self, TypeVar

import torch


@dataclass
class TokenBatch:
    """Prompt+response sequences: prompts left-padded to P columns, responses right-padded to C.

    The response of every row starts at column P, so response log-probs are logits[:, P-1:-1].
    """

    input_ids: torch.Tensor  # (B, P + C) long
    attention_mask: torch.Tensor  # (B, P + C) long, 0 on padding
    response_mask: torch.Tensor  # (B, C) float, 1 on tokens that are trained
    # (B, P + C, L, k) int16: an MoE engine's top-k experts per token and MoE layer, -1 where none was recorded
    # (training.replay); None for a dense model or an engine that records none
    routes: torch.Tensor | None = field(default=None, kw_only=True)

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """The batch, of its own type, with `fn` applied to every tensor field (fields that are None stay None)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: fn(v) for k, v in values.items() if isinstance(v, torch.Tensor)})

    def select(self, rows: torch.Tensor | slice) -> Self:
        """The rows `rows` (an index tensor or a slice) of every tensor field."""
        return self.apply(lambda v: v[rows])

    def split(self, size: int) -> list[Self]:
        """Consecutive slices of at most `size` rows, in order."""
        return [self.select(slice(start, start + size)) for start in range(0, len(self), size)]

    def to(self, device: torch.device) -> Self:
        """The batch with every tensor on `device`."""
        return self.apply(lambda v: v.to(device))


@dataclass
class RolloutBatch(TokenBatch):
    """A scored rollout ready for a policy update."""

    old_logprobs: torch.Tensor | None  # (B, C) behaviour log-probs; None = on-policy (use current)
    ref_logprobs: torch.Tensor | None  # (B, C) reference policy log-probs, when KL is used
    advantages: torch.Tensor  # (B,) per sequence
    rewards: torch.Tensor  # (B,)
    # (B, C) behaviour weights (grpo.behaviour_correction); None = all 1
    is_weights: torch.Tensor | None = None


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> TokenBatch:
    """Pack token lists into a TokenBatch (left-pad prompts, right-pad responses)."""
    if len(prompts) != len(responses):
        raise ValueError("prompts and responses differ in length")
    p_len = max(len(p) for p in prompts)
    c_len = max(1, max(len(r) for r in responses))
    # rows built as lists and converted once: a tensor per row costs more than the copy on GRPO batches
    ids = torch.tensor(
        [
            [pad_id] * (p_len - len(p)) + p + r + [pad_id] * (c_len - len(r))
            for p, r in zip(prompts, responses)
        ],
        dtype=torch.long,
    )
    starts = p_len - torch.tensor([len(p) for p in prompts])[:, None]
    ends = p_len + torch.tensor([len(r) for r in responses])[:, None]
    columns = torch.arange(p_len + c_len)
    attn = ((columns >= starts) & (columns < ends)).long()
    resp_mask = (columns[p_len:] < ends).float()
    return TokenBatch(ids, attn, resp_mask)


B = TypeVar("B", bound="TokenBatch")


def split_rows(batch: B, size: int) -> list[B]:
    """Micro-batches of at most `size` rows, of the batch's own type (`batch.split(size)`)."""
    return batch.split(size)
