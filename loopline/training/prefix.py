"""Forwards that compute each distinct prompt of a batch once: the rows of a GRPO group share their prompt's KV
cache instead of recomputing it group_size times, as the engine shares it when it samples.

The prompt forward runs on one row per distinct prompt; its cache is then indexed out to every row (an indexing
op, so the gradient of each row's loss flows back into the one shared prompt computation) and the responses run
on top of it. Attention, positions and masks are those of the padded forward, so the log-probs are the padded
path's up to float reordering; the backward through the prompt is done once per prompt, not once per row.

A sharded model (FSDP2, TP inside it) gathers or reduces in every forward, so all its ranks must make
the same forwards: it always takes this path (two forwards), even on a slice whose prompts are all distinct.

Both forwards work under activation checkpointing: their caches are pure functions of a layer's input (the prompt's
stores each layer once and hands a recompute its own keys back; the responses' reads the prompt's and never grows),
so a decoder layer recomputed in backward computes what it did in the forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from loopline.data.batches import TokenBatch
from loopline.models.cache import cache_argument, cache_of
from loopline.training.replay import engine_routes


@dataclass(frozen=True)
class SharedPrompts:
    """Which rows of a batch carry the same prompt (same tokens, same left padding)."""

    rows: torch.Tensor  # (U,) one batch row per distinct prompt
    inverse: torch.Tensor  # (B,) the distinct prompt of each row, an index into `rows`


def shared_prompts(batch: TokenBatch, always: bool = False) -> SharedPrompts | None:
    """The batch's distinct prompts, or None when every row has its own (sharing would save nothing) unless
    `always` (then every row is its own prompt's)."""
    p = batch.prompt_len
    mask = batch.attention_mask[:, :p]
    key = torch.cat([batch.input_ids[:, :p] * mask, mask], dim=1)  # what padding holds does not matter
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    if len(distinct) == len(batch):
        if not always:
            return None
        rows = torch.arange(len(batch), device=key.device)
        return SharedPrompts(rows=rows, inverse=rows)
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse, minlength=len(distinct))
    return SharedPrompts(rows=order[torch.cumsum(counts, 0) - counts], inverse=inverse)


def shared_prompt_logits(model: nn.Module, batch: TokenBatch, shared: SharedPrompts) -> torch.Tensor | None:
    """Logits (B, C, V) predicting each row's C response tokens (position t predicts token t + 1, as the padded
    forward's [:, P-1:-1]), each distinct prompt forwarded once. None when the model takes or returns no KV cache.
    """
    argument = cache_argument(model)
    if argument is None:
        return None
    p = batch.prompt_len
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    routes = batch.routes
    with engine_routes(model, routes[shared.rows, :p] if routes is not None else None):
        prompt = model(
            input_ids=batch.input_ids[shared.rows, :p],
            attention_mask=batch.attention_mask[shared.rows, :p],
            position_ids=positions[shared.rows, :p],
            use_cache=True,
            logits_to_keep=1,
            **{argument: PromptCache(getattr(model, "config", None))},
        )
    cache = cache_of(prompt)
    if not isinstance(cache, PromptCache):
        return None
    with engine_routes(model, routes[:, p:] if routes is not None else None):
        responses = model(
            input_ids=batch.input_ids[:, p:],
            attention_mask=batch.attention_mask,
            position_ids=positions[:, p:],
            use_cache=True,
            **{argument: PrefixCache(cache, shared.inverse, getattr(model, "config", None))},
        ).logits
    first = prompt.logits[:, -1][shared.inverse]  # the last prompt token predicts the first response token
    return torch.cat([first.unsqueeze(1), responses[:, :-1]], dim=1)


# whether this transformers' DynamicCache takes the model's config (it tells sliding-window layers apart)
_CACHE_TAKES_CONFIG = "config" in inspect.signature(DynamicCache.__init__).parameters


def _empty_cache_args(config: object) -> dict:
    """DynamicCache's constructor arguments: the model's config where this transformers takes one."""
    return {"config": config} if _CACHE_TAKES_CONFIG and config is not None else {}


class PromptCache(DynamicCache):
    """The prompt forward's cache: each layer's keys and values stored once. A recompute of a checkpointed layer
    (in backward) gets its own keys and values back and stores nothing, as the first forward saw an empty cache."""

    recomputable = True  # training.parallel checkpoints a layer that takes this cache

    def __init__(self, config: object = None) -> None:
        super().__init__(**_empty_cache_args(config))
        self.stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.stored:
            return key_states, value_states
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.stored[layer_idx] = (keys, values)
        return keys, values


class PrefixCache(DynamicCache):
    """Every row's prompt keys and values (the prompt cache's, indexed out by `inverse`: the gradient of each row
    flows back into its one prompt), read by the response forward and never extended."""

    recomputable = True

    def __init__(self, prompt: PromptCache, inverse: torch.Tensor, config: object = None) -> None:
        super().__init__(**_empty_cache_args(config))
        self.prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, (keys, values) in sorted(prompt.stored.items()):
            self.prefix[layer] = (keys[inverse], values[inverse])
            super().update(*self.prefix[layer], layer)  # the cache's length and mask sizes: the prompt's

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.prefix[layer_idx]
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)
