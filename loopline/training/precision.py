"""Mixed precision (training.mixed_precision=bf16): float32 master weights, bfloat16 compute, float32 gradients.

The parameters a trainer owns stay float32: the optimizer steps them, AdamW's moments are float32, checkpoints and
the weight sync read them. Each forward runs on bfloat16 copies of them, so matmuls, activations and the gradients
backward computes are bfloat16; each parameter's gradient is cast to float32 where it leaves its bfloat16 copy and
is accumulated (over micro-batches) and reduced (over ranks) in float32.

- On FSDP2 ranks this is `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (`fsdp_policy`): FSDP2
  all-gathers each unit's parameters in bfloat16 and reduce-scatters the gradients in float32.
- On the local backend (one unsharded process) `cast_in_forward` does the same casts with module hooks: once per
  forward of the root model every parameter gets one bfloat16 copy (a tied embedding and head share it, as they
  share FSDP2's unsharded parameter), which the modules use in place of their float32 parameter for that forward.

Why not autocast: CPU autocast runs only listed ops (matmuls) in bfloat16 and keeps the residual stream, norms
and embeddings in float32, so its numbers are not FSDP2's; casting the parameters gives the same computation on
both backends (a bfloat16 model's forward over float32 masters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16}  # training.mixed_precision -> compute dtype


def fsdp_policy(mode: str) -> Any:
    """FSDP2's mixed-precision policy for training.mixed_precision (`mode` "none": compute in the weights' dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mode not in COMPUTE_DTYPES:  # none, or an auto no plan resolved (eval, generate): the weights' dtype
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[mode], reduce_dtype=torch.float32)


class _Casts:
    """The bfloat16 copies of one root forward, by parameter (None outside a root forward)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.copies: dict[nn.Parameter, torch.Tensor] | None = None
        self.depth = 0

    def copy(self, param: nn.Parameter) -> torch.Tensor:
        """`param` in the compute dtype: one differentiable cast per root forward (a module called outside one,
        as the chunked log-probs call the head, casts for that call)."""
        if self.copies is None:
            return param.to(self.dtype)
        if param not in self.copies:
            self.copies[param] = param.to(self.dtype)
        return self.copies[param]


def cast_in_forward(model: nn.Module, mode: str) -> nn.Module:
    """The local backend's mixed precision: every forward of `model` (and of its submodules called alone) runs on
    compute-dtype copies of its floating-point parameters, whose gradients arrive in the parameters' own dtype.
    In place and idempotent; names, state dicts and the optimizer see the float32 parameters. A deep copy (the
    frozen reference) computes the same way."""
    if mode not in COMPUTE_DTYPES or getattr(model, "_loopline_casts", None) is not None:
        return model
    casts = _Casts(COMPUTE_DTYPES[mode])
    model.__dict__["_loopline_casts"] = casts  # marks the model (and travels with a deep copy)
    model.register_forward_pre_hook(_open)
    model.register_forward_hook(_close, always_call=True)
    for module in model.modules():
        if any(p is not None and p.is_floating_point() for p in module._parameters.values()):
            module.__dict__["_loopline_casts"] = casts
            module.register_forward_pre_hook(_swap_in)
            module.register_forward_hook(_swap_out, always_call=True)
    return model


def _open(model: nn.Module, args: Any) -> None:
    casts: _Casts = model.__dict__["_loopline_casts"]
    if casts.depth == 0:
        casts.copies = {}
    casts.depth += 1


def _close(model: nn.Module, args: Any, output: Any) -> None:
    casts: _Casts = model.__dict__["_loopline_casts"]
    casts.depth -= 1
    if casts.depth == 0:
        casts.copies = None  # the copies live on only in the autograd graph, until its backward


def _swap_in(module: nn.Module, args: Any) -> None:
    casts: _Casts = module.__dict__["_loopline_casts"]
    masters = {n: p for n, p in module._parameters.items() if p is not None and p.is_floating_point()}
    module.__dict__["_loopline_masters"] = masters
    for name, param in masters.items():
        # a plain tensor where the Parameter was, for this call only: module.weight reads it
        module._parameters[name] = casts.copy(param)  # type: ignore[assignment]  # a Tensor, not a Parameter


def _swap_out(module: nn.Module, args: Any, output: Any) -> None:
    masters = module.__dict__.pop("_loopline_masters", None)
    if masters:
        module._parameters.update(masters)
