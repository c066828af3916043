"""Router health of mixture-of-experts layers: how evenly the tokens spread over the experts (the coefficient of
variation of tokens per expert) and the Switch Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6).

Both are ratios of per-expert sums (top-k assignments, router probabilities) over token counts: the sums add up
over micro-batches, forwards and data-parallel ranks first and the ratios are taken once, so a step's value does
not depend on how its tokens were split.
"""

from __future__ import annotations

import torch


def expert_counts(indices: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k assignments per expert over the real tokens, (E,) float32. indices: (N, k) the experts each token was
    routed to; mask: (N,) 1 on real tokens, 0 on padding (None: every token)."""
    weights = torch.ones(indices.shape, dtype=torch.float32, device=indices.device)
    if mask is not None:
        weights = weights * mask.to(torch.float32).unsqueeze(-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=indices.device)
    return counts.scatter_add_(0, indices.reshape(-1).long(), weights.reshape(-1))


def router_prob_sums(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The router's softmax probabilities summed over the real tokens, (E,) float32 (with the logits' gradient).
    logits: (N, E); mask: (N,) as expert_counts'."""
    probs = torch.softmax(logits.float(), dim=-1)
    if mask is not None:
        probs = probs * mask.to(probs.dtype).unsqueeze(-1)
    return probs.sum(dim=0)


def coefficient_of_variation(counts: torch.Tensor) -> torch.Tensor:
    """Standard deviation over mean of the tokens per expert, along the last dim (population std: the experts are
    all there are); 0 = perfectly balanced, sqrt(E - 1) = every token on one expert, 0 where there are no tokens."""
    mean = counts.mean(dim=-1)
    std = counts.std(dim=-1, correction=0)
    return torch.where(mean > 0, std / mean.clamp(min=torch.finfo(mean.dtype).tiny), torch.zeros_like(mean))


def load_balancing_loss(
    counts: torch.Tensor, prob_sums: torch.Tensor, tokens: torch.Tensor | float
) -> torch.Tensor:
    """E * sum_e f_e * P_e, with f_e = counts_e / tokens the top-k assignments per token to expert e (they sum to
    k) and P_e = prob_sums_e / tokens its mean router probability: k at perfect balance, k * E when every token
    goes to the same experts. counts, prob_sums: (..., E); tokens: (...). The gradient flows through P only. Over several layers, pass the sums over the
    layers and the tokens times the layers: transformers' definition (one loss pooled over all layers)."""
    num_experts = counts.shape[-1]
    # (...) tokens per row of sums, as (..., 1): one count per layer, or one for all
    tokens = torch.as_tensor(tokens, dtype=prob_sums.dtype, device=prob_sums.device)
    tokens = tokens.clamp(min=1.0).unsqueeze(-1)
    f = counts.to(prob_sums.dtype) / tokens
    return num_experts * (f * (prob_sums / tokens)).sum(dim=-1)
