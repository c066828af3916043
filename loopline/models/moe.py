"""Mixture-of-experts models: their routers, found as the modules whose output transformers records as
`router_logits` (Qwen3-MoE's and Mixtral's `...TopKRouter`), and a hook that reads each router call's logits and
chosen experts. Dense models have no routers: every function here then returns nothing to do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Router:
    """One MoE layer's router."""

    layer: int  # index of the decoder layer it routes for (its module name's `layers.N`)
    module: nn.Module


def recording_model(model: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face model inside `model` (itself, or the one a peft, FSDP2 or scalar-head wrapper
    holds) whose class records `router_logits`: an MoE model's; None for a dense one."""
    return next((m for m in model.modules() if _router_spec(m) is not None), None)


def _router_spec(module: nn.Module) -> tuple[type[nn.Module], int] | None:
    """The router class a Hugging Face model class records `router_logits` from, and the logits' index in its
    output."""
    spec = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
    if spec is None:
        return None
    return (spec, 0) if isinstance(spec, type) else (spec.target_class, spec.index)


def router_logits_index(outer: nn.Module) -> int:
    """Where the logits sit in a router call's output, for an MoE model's outermost recording model
    (recording_model)."""
    spec = _router_spec(outer)
    if spec is None:
        raise ValueError(f"{type(outer).__name__} records no router_logits (not a mixture of experts)")
    return spec[1]


def routers(model: nn.Module) -> list[Router]:
    """The model's routers in layer order; [] for a dense model (also one wrapped by peft or FSDP2)."""
    outer = recording_model(model)
    if outer is None:
        return []
    cls = _router_spec(outer)[0]  # type: ignore[index]  # recording_model found one
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]
    return [
        Router(int(match.group(1)) if (match := _LAYER.search(name)) else i, m)
        for i, (name, m) in enumerate(named)
    ]


def moe_config(model: nn.Module) -> tuple[int, int]:
    """(experts per MoE layer, experts per token) of a model's Hugging Face config."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return int(experts), int(config.num_experts_per_tok)


def router_outputs(output: Any, logits_index: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A router call's logits (N, E) and the experts it chose (N, k): the integer tensor of its output (Qwen3-MoE
    and Mixtral return logits, weights, indices), else the top-k of the logits."""
    parts = output if isinstance(output, tuple | list) else (output,)
    logits = parts[logits_index]
    chosen = next(
        (t for t in parts if isinstance(t, torch.Tensor) and not t.is_floating_point()),
        None,
    )
    if chosen is None:
        chosen = torch.topk(logits, top_k, dim=-1).indices
    return logits, chosen


def add_router_hooks(
    model: nn.Module, on_call: Callable[[int, torch.Tensor, torch.Tensor], None]
) -> list[RemovableHandle]:
    """Call on_call(position of the router in routers(model), logits (N, E), chosen experts (N, k)) at every call
    of one of the model's routers, until the returned handles are removed; none for a dense model."""
    outer = recording_model(model)
    if outer is None:
        return []
    logits_index = _router_spec(outer)[1]  # type: ignore[index]  # recording_model found one
    top_k = moe_config(outer)[1]
    handles = []
    for position, router in enumerate(routers(model)):

        def hook(module: nn.Module, args: Any, output: Any, position: int = position) -> None:
            on_call(position, *router_outputs(output, logits_index, top_k))

        handles.append(router.module.register_forward_hook(hook))
    return handles


@contextmanager
def router_hooks(
    model: nn.Module, on_call: Callable[[int, torch.Tensor, torch.Tensor], None]
) -> Iterator[None]:
    """add_router_hooks for the duration of the block."""
    handles = add_router_hooks(model, on_call)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
