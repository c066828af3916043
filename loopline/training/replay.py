"""Rollout routing replay: the trainer's forwards on sampled sequences compared with (and, with replay on, routed
by) the experts the engine's routers chose for the same tokens (grpo.routing_replay).

A batch carries the engine's routes as `routes` (B, P + C, L, k), aligned with its `input_ids`, -1 where none was
recorded (padding, a sequence's last token). Each forward that takes a batch's tokens wraps its model call in
`engine_routes(model, routes)` with the routes laid out as that call's input (padded rows, a shared prompt's
rows, packed rows). A model that a trainer registered (`RouteReplay`) then, at each router call:
- counts, in forwards that train, the tokens whose top-k experts (as a set) the trainer's router chose
  differently from the engine's (route_mismatch);
- with replay on, in every forward (the log-prob forwards too, so the ratio's two sides route alike), swaps the
  chosen experts for the engine's and recomputes their weights from the trainer's own router probabilities, as
  the router computes them for its own choice (softmax, the chosen experts' probabilities, renormalised where the
  model normalises them).
A model no trainer registered (the reference, the critic) ignores the routes.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from loopline.models.moe import moe_config, recording_model, router_logits_index, router_outputs, routers
from loopline.training.parallel import all_reduce_sum

_replays: weakref.WeakKeyDictionary[nn.Module, RouteReplay] = weakref.WeakKeyDictionary()


class RouteReplay:
    """A trainer model's routers against the engine's routes: mismatch counts, and the routes imposed if `replay`."""

    def __init__(self, model: nn.Module, replay: bool) -> None:
        outer = recording_model(model)
        if outer is None:
            raise ValueError(
                f"{type(model).__name__} has no routers (not a mixture of experts): no routes to replay"
            )
        self.replay = replay
        self._index = router_logits_index(outer)
        self._top_k = moe_config(outer)[1]
        self._routes: torch.Tensor | None = None  # (N, L, k) for the forward running, -1 = none
        # (differing routes, routed tokens) of the training forwards, kept where the router runs: no copy to the
        # host per router call
        self._counts: torch.Tensor | None = None
        old = _replays.get(model)  # a later phase's trainer on the same model replaces its hooks
        for handle in old.handles if old is not None else []:
            handle.remove()
        self.handles: list[RemovableHandle] = [
            r.module.register_forward_hook(lambda m, a, out, i=i: self._on_call(m, i, out))
            for i, r in enumerate(routers(model))
        ]
        _replays[model] = self

    def _on_call(self, module: nn.Module, layer: int, output: Any) -> Any:
        if self._routes is None:
            return None
        logits, chosen = router_outputs(output, self._index, self._top_k)
        want = self._routes[:, layer].to(chosen.device, torch.long)  # (N, k)
        if len(want) != len(chosen):
            raise RuntimeError(
                f"routing replay: a router saw {len(chosen)} tokens, the engine's routes cover {len(want)}"
            )
        known = want[:, 0] >= 0
        if torch.is_grad_enabled() and module.training:
            differ = (want.sort(-1).values != chosen.sort(-1).values).any(-1) & known
            counts = torch.stack([differ.sum(), known.sum()])
            self._counts = counts if self._counts is None else self._counts + counts
        if not self.replay:
            return None
        experts = torch.where(known.unsqueeze(-1), want, chosen.long()).to(chosen.dtype)
        return _replace_choice(output, logits, experts, getattr(module, "norm_topk_prob", True))

    def metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """route_mismatch over every rank's training forwards since the last call (then reset); {} when no
        forward had routes. Every data-parallel rank calls it at the same point: it all-reduces."""
        local = (
            self._counts.double().cpu() if self._counts is not None else torch.zeros(2, dtype=torch.float64)
        )
        self._counts = None
        differ, tokens = all_reduce_sum(local, group).tolist()
        return {"route_mismatch": differ / tokens} if tokens else {}


def _replace_choice(output: Any, logits: torch.Tensor, experts: torch.Tensor, normalise: bool) -> Any:
    """The router's (logits, weights, experts) output with `experts` chosen: their weights are the router's
    probabilities of those experts (renormalised over them where the router renormalises its own top-k)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, experts.long())
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    parts = list(output)
    for i, part in enumerate(parts):
        if isinstance(part, torch.Tensor) and part is not logits:
            parts[i] = experts if not part.is_floating_point() else weights.to(part.dtype)
    return type(output)(parts) if isinstance(output, tuple) else parts


@contextmanager
def engine_routes(model: nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """The engine's routes (rows, W, L, k) of the tokens of the model call inside the block (its input_ids' layout),
    for the model's RouteReplay; nothing when the model has none or there are no routes."""
    replay = _replays.get(model)
    if replay is None or routes is None:
        yield
        return
    replay._routes = routes.flatten(0, 1)
    try:
        yield
    finally:
        replay._routes = None


def sample_routes(
    routes: list[torch.Tensor | None], prompt_lengths: list[int], prompt_width: int, width: int
) -> torch.Tensor | None:
    """The routes of B sampled sequences, each (P_i + T_i - 1, L, k) from its engine, laid out as `collate` lays
    out their tokens (prompts left-padded to prompt_width, width columns in all): (B, width, L, k), -1 where none.
    None when any sequence has none (a dense model, an engine that records none)."""
    if not routes or any(r is None for r in routes):
        return None
    first = routes[0]
    assert first is not None
    out = torch.full((len(routes), width, *first.shape[1:]), -1, dtype=first.dtype)
    for i, (r, p) in enumerate(zip(routes, prompt_lengths)):
        assert r is not None
        start = prompt_width - p
        out[i, start : start + len(r)] = r
    return out
