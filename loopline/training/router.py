"""Router health of a trainer's mixture-of-experts model over each step, and its auxiliary load-balancing loss.

Hooks on the model (registered once, for the model's life) read every router call of the forwards that run with gradients:
the training forwards, not the log-prob forwards under no_grad, nor a checkpointed layer's recompute in the
backward (it runs after the model's own forward has returned). Padding is left out where the forward has an
attention mask (a packed forward has none: its rows' few trailing pad slots count). The statistics are per-expert
sums, added up over the step's micro-batches and the data-parallel ranks before the ratios are taken
(loopline.algorithms.moe). A dense model gets no hooks, no loss term and no metrics.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loopline.algorithms.moe import (
    coefficient_of_variation,
    expert_counts,
    load_balancing_loss,
    router_prob_sums,
)
from loopline.models.moe import add_router_hooks, moe_config, recording_model, routers
from loopline.training.parallel import all_reduce_sum


def aux_loss_coef(model: nn.Module, coef: float | None) -> float:
    """model.router_aux_loss_coef: `coef`, or (None) what transformers' own training forward adds for the model's
    config: its router_aux_loss_coef when its output_router_logits is on, else 0; 0 for a dense model."""
    if coef is not None:
        return coef
    outer = recording_model(model)
    config = getattr(outer, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


class _Recorder:
    """The router calls of one model's training forwards: hooks registered once per model, for its life (each
    phase's trainer reads them through its own RouterStats)."""

    def __init__(self, model: nn.Module, outer: nn.Module) -> None:
        # (router position, logits (N, E), chosen experts (N, k), real-token mask (N,) or None), until taken
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.mask: torch.Tensor | None = None
        self.armed = False
        outer.register_forward_pre_hook(self._arm, with_kwargs=True)
        outer.register_forward_hook(self._disarm)
        add_router_hooks(model, self._record)

    def _arm(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """A forward of the model begins: record its router calls if it trains, with its tokens' padding mask."""
        self.armed = torch.is_grad_enabled() and module.training
        ids, mask = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
        self.mask = None
        if self.armed and ids is not None and mask is not None and mask.dim() == 2:
            # a forward on a cache (a shared prompt's responses) has a mask over the cache's columns too
            self.mask = mask[:, -ids.shape[1] :].reshape(-1)

    def _disarm(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.armed = False

    def _record(self, position: int, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        if self.armed:
            mask = self.mask if self.mask is not None and self.mask.numel() == len(logits) else None
            self.calls.append((position, logits, chosen, mask))

    def take(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        calls, self.calls = self.calls, []
        return calls


_recorders: weakref.WeakKeyDictionary[nn.Module, _Recorder] = weakref.WeakKeyDictionary()


class RouterStats:
    """A trainer model's routers: the auxiliary loss of each micro-batch (objective) and the step's load-balance
    metrics (metrics). Every data-parallel rank calls metrics() at the same point: it all-reduces."""

    def __init__(self, model: nn.Module, coef: float | None = None) -> None:
        """coef: model.router_aux_loss_coef (None: aux_loss_coef's default)."""
        self.layers = [r.layer for r in routers(model)]
        if coef and not self.layers:
            raise ValueError(
                f"model.router_aux_loss_coef={coef}: {type(model).__name__} has no router (not a mixture of experts)"
            )
        self.coef = aux_loss_coef(model, coef) if self.layers else 0.0
        outer = recording_model(model)
        if outer is None:
            return
        if model not in _recorders:
            _recorders[model] = _Recorder(model, outer)
        self._recorder = _recorders[model]
        self._recorder.take()  # an earlier phase's leftovers are not this one's
        self.num_experts = moe_config(outer)[0]
        shape = (len(self.layers), self.num_experts)
        self._counts = torch.zeros(shape, dtype=torch.float64)  # top-k assignments per layer and expert
        self._probs = torch.zeros(shape, dtype=torch.float64)  # summed router probabilities
        self._tokens = torch.zeros(len(self.layers), dtype=torch.float64)  # real tokens each layer routed

    def objective(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` plus coef x the load-balancing loss of the router calls since the last call (a micro-batch's
        forwards; pooled over layers as transformers defines it), which the step's metrics then count; `loss`
        itself when the coefficient is 0 or the model dense."""
        if not self.layers:
            return loss
        calls = self._recorder.take()
        if not calls:
            return loss
        counts = torch.zeros((len(self.layers), self.num_experts), device=calls[0][1].device)  # (L, E)
        probs = torch.zeros_like(counts)  # (L, E), with the router logits' gradient
        tokens = torch.zeros(len(self.layers), device=counts.device)  # (L,)
        for position, logits, chosen, mask in calls:
            counts[position] += expert_counts(chosen, self.num_experts, mask)
            probs[position] += router_prob_sums(logits, mask)
            tokens[position] += mask.sum() if mask is not None else len(logits)
        # one copy to the host per micro-batch, not one per router call
        self._counts += counts.double().cpu()
        self._probs += probs.detach().double().cpu()
        self._tokens += tokens.double().cpu()
        if not self.coef:
            return loss
        aux = load_balancing_loss(counts.sum(0), probs.sum(0), tokens.sum())
        return loss + self.coef * aux.to(loss.device)

    def metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """The step's router metrics over every rank's tokens (then reset): per layer the coefficient of variation
        of tokens per expert and the load-balancing loss, their means over layers and the pooled loss."""
        if not self.layers:
            return {}
        sums = torch.cat([self._counts.flatten(), self._probs.flatten(), self._tokens])
        sums = all_reduce_sum(sums, group)
        n = self._counts.numel()
        counts, probs = sums[:n].view_as(self._counts), sums[n : 2 * n].view_as(self._probs)
        tokens = sums[2 * n :]
        self._counts.zero_(), self._probs.zero_(), self._tokens.zero_()
        cv = coefficient_of_variation(counts)
        per_layer = load_balancing_loss(counts, probs, tokens)
        pooled = load_balancing_loss(counts.sum(0), probs.sum(0), tokens.sum())
        row = {"router_cv": float(cv.mean()), "router_aux_loss": float(pooled)}
        for i, layer in enumerate(self.layers):
            row[f"router_cv_layer{layer}"] = float(cv[i])
            row[f"router_aux_loss_layer{layer}"] = float(per_layer[i])
        return row
