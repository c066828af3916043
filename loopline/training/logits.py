"""Next-token log-probs and entropies without the whole (rows x tokens x vocabulary) logits.

At a real vocabulary (150k tokens) the float32 logits of a micro-batch dwarf the model's activations: 16 rows x
1,024 tokens x 151,936 x 4 bytes is 10 GB, and log_softmax, its gradient and the entropy each make another of the
same size. Here the model runs to its last hidden states (its head swapped for the identity for the forward), and
the head, log_softmax, the gather of the target token and the entropy run on `chunk` tokens at a time; each
chunk's logits are recomputed in the backward (torch.utils.checkpoint) instead of being kept, so a step holds
the hidden states plus one chunk's (chunk x vocabulary) logits at a time.

What was simplified: the chunks run over tokens only (rows x tokens flattened). Splitting the vocabulary as well
(an online log-sum-exp over vocabulary slices) pays only when one token's row of logits is itself too big, which
no dense model of today's vocabularies reaches at chunk sizes of a few hundred tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loopline.algorithms.losses import entropy_from_logprobs


@dataclass(frozen=True)
class TokenScores:
    """Per-token results of the head over N positions; each (N,) in float32 (float64 for a float64 model), or
    None when not asked for."""

    logp: torch.Tensor  # log-prob of the target token at T = 1
    entropy: torch.Tensor | None  # entropy of the next-token distribution at T = 1
    tempered: torch.Tensor | None  # log-prob of the target token at the sampling temperature


@contextmanager
def hidden_states_out(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, `model`'s forward returns its last hidden states (after the final norm) where its logits
    were, (..., H) instead of (..., V); yields the head (`model.get_output_embeddings()`) to apply afterwards.
    The head module stays in place (its weights, names and any FSDP2 hooks on the root are untouched): only its
    forward is the identity meanwhile."""
    head = model.get_output_embeddings()  # type: ignore[operator]  # an HF model's method, not a submodule
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has no output embeddings (an LM head) to compute log-probs with"
        )
    head.forward = _identity  # an instance attribute: it shadows the class's forward until deleted
    try:
        yield head
    finally:
        del head.forward


def at_least_float32(values: torch.Tensor) -> torch.Tensor:
    """Low-precision logits (bf16, fp16) as float32 for the softmax; float32 and float64 as they are."""
    return values.float() if values.dtype in (torch.bfloat16, torch.float16) else values


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def head_scores(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    with_entropy: bool = False,
    temperature: float | None = None,
    entropy_grad: bool = True,
) -> TokenScores:
    """The head's log-prob of each target token (and the entropy, and the log-prob at `temperature`), `chunk`
    positions at a time. hidden: (N, H) hidden states, targets: (N,) token ids. With gradients, each chunk's
    logits are recomputed in the backward rather than kept: the step never holds more than one chunk's.
    entropy_grad=False: the entropy is a statistic only (no entropy bonus), computed without a graph, so that
    backward does not run a (chunk x vocabulary) gradient of zeros through it."""
    channels = 1 + with_entropy + (temperature is not None)

    def scores(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = at_least_float32(
            head(h)
        )  # (c, V): the only vocabulary-wide tensors live here, one chunk at a time
        every = torch.log_softmax(logits, dim=-1)
        out = [every.gather(-1, t.unsqueeze(-1)).squeeze(-1)]
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                out.append(entropy_from_logprobs(every))
        if temperature is not None:
            out.append(
                torch.log_softmax(logits / temperature, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
            )
        return torch.stack(out, dim=-1)  # (c, channels)

    recompute = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    parts = []
    for start in range(0, hidden.shape[0], max(1, chunk)):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        parts.append(checkpoint(scores, h, t, use_reentrant=False) if recompute else scores(h, t))
    out = torch.cat(parts) if parts else at_least_float32(hidden.new_zeros((0, channels)))
    columns = iter(out.unbind(-1))
    logp = next(columns)
    entropy = next(columns) if with_entropy else None
    tempered = next(columns) if temperature is not None else None
    return TokenScores(logp, entropy, tempered)
