"""The optimizer of every trainer: AdamW with a warmup-then-decay schedule, stepped a chunk of weights at a time
so that its temporaries stay one chunk's."""

from __future__ import annotations

import math

import torch

from loopline.training.config import STEP_CHUNK_BYTES, OptimConfig
from loopline.training.parallel import clip_grad_norm, mesh_groups


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW plus linear warmup then constant/cosine/linear decay to min_lr_ratio.

    One parameter group per device mesh (one in all but TP + FSDP2): AdamW's foreach kernels run per group.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": group} for group in mesh_groups(params)]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.schedule == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    grad_clip: float,
    lr_scale: float = 1.0,
) -> tuple[float, float]:
    """Clip the global grad norm, step at the schedule's lr times lr_scale (skipped when the norm is not finite),
    zero grads; (grad_norm, lr used)."""
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    return float(grad_norm), apply_update(optimizer, scheduler, grad_norm, lr_scale)


def step_chunks(params: list[torch.Tensor], max_bytes: int = STEP_CHUNK_BYTES) -> list[list[torch.Tensor]]:
    """`params` in order, cut into runs of at most `max_bytes` (as float32) each; a larger tensor is a run alone."""
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if chunks[-1] and size + p.numel() * 4 > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += p.numel() * 4
    return [c for c in chunks if c]


def step_in_chunks(optimizer: torch.optim.Optimizer, max_bytes: int = STEP_CHUNK_BYTES) -> None:
    """optimizer.step() on a chunk of the weights at a time (each group's share of it). torch's foreach AdamW takes
    the root of every second moment of one call at once: a float32 copy of the trainable weights (1.0-1.7 GiB at
    the 0.5B shape, the step's peak with the memory switches on); a chunk at a time it is one chunk's. Every
    weight is updated once, by the same elementwise kernels: bitwise the update of one call (and one call where
    the weights fit one chunk)."""
    whole = [group["params"] for group in optimizer.param_groups]
    owner = {id(p): i for i, params in enumerate(whole) for p in params}
    try:
        for chunk in step_chunks([p for params in whole for p in params], max_bytes):
            for i, group in enumerate(optimizer.param_groups):
                group["params"] = [p for p in chunk if owner[id(p)] == i]
            optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, whole, strict=True):
            group["params"] = params


def apply_update(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    grad_norm: torch.Tensor,
    lr_scale: float = 1.0,
) -> float:
    """The update of a step whose (clipped) grad norm is `grad_norm`: skipped when it is not finite; the lr used."""
    lr = scheduler.get_last_lr()[0] * lr_scale
    if torch.isfinite(grad_norm):
        for group in optimizer.param_groups:
            group["lr"] *= lr_scale  # for this step: the scheduler's next step sets every group's lr afresh
        step_in_chunks(optimizer)
        scheduler.step()
    # else: a non-finite gradient would poison the weights and AdamW moments: skip this update
    optimizer.zero_grad(set_to_none=True)
    return float(lr)
