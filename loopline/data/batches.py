"""Typed batches that cross stage boundaries (tokens, masks, log-probs, advantages)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TypeVar

import torch


@dataclass
class TokenBatch:
    """Prompt+response sequences: prompts left-padded to P columns, responses right-padded to C.

    The response of every row starts at column P, so response log-probs are logits[:, P-1:-1].
    """

    input_ids: torch.Tensor  # (B, P + C) long
    attention_mask: torch.Tensor  # (B, P + C) long, 0 on padding
    response_mask: torch.Tensor  # (B, C) float, 1 on tokens that are trained

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


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
    batch = len(prompts)
    p_len = max(len(p) for p in prompts)
    c_len = max(1, max(len(r) for r in responses))
    ids = torch.full((batch, p_len + c_len), pad_id, dtype=torch.long)
    attn = torch.zeros((batch, p_len + c_len), dtype=torch.long)
    resp_mask = torch.zeros((batch, c_len), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p, dtype=torch.long)
        attn[i, p_len - len(p) : p_len] = 1
        if r:
            ids[i, p_len : p_len + len(r)] = torch.tensor(r, dtype=torch.long)
            attn[i, p_len : p_len + len(r)] = 1
            resp_mask[i, : len(r)] = 1.0
    return TokenBatch(ids, attn, resp_mask)


B = TypeVar("B", bound="TokenBatch")


def split_rows(batch: B, size: int) -> list[B]:
    """Micro-batches of at most `size` rows (every tensor field sliced along dim 0), of the batch's own type."""
    out: list[B] = []
    for start in range(0, len(batch), size):
        sliced = {
            f.name: (v[start : start + size] if isinstance(v, torch.Tensor) else v)
            for f in fields(batch)
            for v in [getattr(batch, f.name)]
        }
        out.append(replace(batch, **sliced))
    return out
