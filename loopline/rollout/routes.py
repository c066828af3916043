"""The experts a mixture-of-experts model's routers chose while an engine generated: for routing replay (the
trainer's forward on the samples reusing the engine's routes) and for measuring how often the two disagree.

Routes are recorded per sequence position, for every position whose output is read: the prompt's tokens and every
generated token but the last (whose output no sampled token came from). A completion's routes are (P + T - 1, L,
k) for a prompt of P tokens and T generated ones: position t's top-k experts in each of the L MoE layers, the
same positions a trainer's forward of prompt + completion routes, in the same order. A partial rollout
(weights taken mid-generation, the cache recomputed) keeps each position's routes as the weights that sampled
from it chose them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from loopline.models.moe import moe_config, recording_model, router_hooks, routers


class RouteRecorder:
    """One generate call's routes: hooks on the routers read each forward's choices, which the engine then files
    by sequence after its prefills and decode steps."""

    def __init__(self, model: nn.Module, total: int, max_new: int) -> None:
        """total: the call's sequences (prompts x n); max_new: the most tokens each generates."""
        outer = recording_model(model)
        if outer is None:
            raise ValueError(f"{type(model).__name__} has no routers to record (not a mixture of experts)")
        self.model = model
        self.layers, self.top_k = len(routers(model)), moe_config(outer)[1]
        self._last: list[torch.Tensor | None] = [None] * self.layers  # each router's last call, (N, k)
        self.prompts: dict[int, torch.Tensor] = {}  # prompt index -> (P, L, k) routes of its tokens
        # (total, max_new, L, k): column j is the position whose output sampled token j (the prompt's last, then
        # each generated token); int16 holds any expert index of today's models (at most a few hundred)
        self.generated = torch.zeros((total, max_new, self.layers, self.top_k), dtype=torch.int16)

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """Read every router call within the block."""

        def on_call(position: int, logits: torch.Tensor, chosen: torch.Tensor) -> None:
            self._last[position] = chosen

        with router_hooks(self.model, on_call):
            yield

    def _forward_routes(self, rows: int) -> torch.Tensor:
        """The last forward's routes, (rows, W, L, k), for a forward of `rows` rows."""
        chosen = [c for c in self._last if c is not None]
        assert len(chosen) == self.layers, "a forward ran outside RouteRecorder.hooks"
        return torch.stack([c.view(rows, -1, self.top_k) for c in chosen], dim=2).to("cpu", torch.int16)

    def prefilled(self, prompts: list[list[int]], first: int, n: int) -> None:
        """After the prefill of prompts first, first + 1, ... (left-padded, one row each, before their n
        samples were made): their tokens' routes, and the routes that sample each of their samples' first token."""
        routes = self._forward_routes(len(prompts))  # (B, W, L, k)
        for i, prompt in enumerate(prompts):
            self.prompts[first + i] = routes[i, routes.shape[1] - len(prompt) :]
            self.generated[(first + i) * n : (first + i + 1) * n, 0] = routes[i, -1]

    def stepped(self, sample: torch.Tensor, count: torch.Tensor, live: torch.Tensor) -> None:
        """After a forward of a batch's rows (a decode step; or a recompute, whose rows' last column counts): the
        routes that sample each live row's next token, token `count` of sequence `sample`."""
        routes = self._forward_routes(len(sample))[:, -1]  # (B, L, k)
        # a decode step runs finished rows too: only live ones are filed
        rows = live.nonzero().flatten().cpu()
        self.generated[sample.cpu()[rows], count.cpu()[rows]] = routes[rows]

    def routes(self, sample: int, prompt: int, length: int) -> torch.Tensor:
        """The routes of sample `sample` (of prompt index `prompt`, `length` tokens generated): (P + length - 1,
        L, k), every position's but the last."""
        return torch.cat([self.prompts[prompt][:-1], self.generated[sample, :length]])
