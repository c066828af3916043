"""One rule for comparing weights after AdamW steps taken on two layouts (FSDP, TP, PP, packed, Ray vs local).

Why a rule and not a tolerance: two layouts sum the same gradient in different orders, so each gradient
element differs by float noise of order eps_float32 x the size of the terms summed. AdamW's first steps move
an element by about lr x g / (|g| + eps_adam): a gradient that is well above its noise moves the weight the
same way on both layouts, but one whose true value is ~0 is *only* noise, and AdamW divides that noise by its
own root: the weight moves by up to ~lr on one layout and by a different amount (or the other way) on the
other. Which elements land there depends on the CPU's kernels (an AMD EPYC with avx512_bf16 and an Intel
Xeon round differently), so no fixed atol holds everywhere, and loosening one parameter at a time does not
generalise.

The rule (`assert_adam_updates_close`):

1. Gradients are compared tightly, step by step (rtol 1e-4, atol 1e-7): a wrong denominator, a missing
   all-reduce or a factor of the world size shows there, before AdamW can hide it.
2. An element is *resolved* when, at every step, its gradient is bit-identical on both layouts, or on both
   above the noise floor NOISE_FLOOR x eps_float32 x max|g| of its tensor (NOISE_FLOOR = 1e3) with the two
   differing by r <= R_MAX = 1e-2 relative. Its two updates are then the same function of gradients that
   agree to r, so its weights must agree to atol + 2 r x sum_t lr_t B_t (first-order: m-hat and sqrt(v-hat)
   each move by at most r relative, and |m-hat / sqrt(v-hat)| <= B_t), r being the element's own worst step.
3. An unresolved element is noise-dominated: AdamW's direction there is not determined by the maths. Each
   layout's own move from the starting weights is only bounded by what AdamW can do at all,
   sum_t lr_t (B_t + weight_decay |w|), where B_t = sqrt(sum_s a_s^2 / b_s) is the Cauchy-Schwarz bound of
   |m-hat_t / sqrt(v-hat_t)| over AdamW's bias-corrected weights a_s (beta1) and b_s (beta2) (B_1 = 1).
4. At least `min_resolved` of the elements (default 0.95) must be resolved (measured: 97-99.6%), so the
   rule can never quietly turn into "anything within lr".

Without recorded gradients (a Ray run compared with a local one through their checkpoints), step 2 cannot
be decided per element: then an element is taken as unresolved only if its weights differ by more than
atol + R_FREE x sum_t lr_t B_t (R_FREE = 1e-3: what a gradient ~2,000 times above its noise allows), at most
`max_unresolved` of the elements may (default 1e-3; measured: 6e-5 of the built-in model after 3 TP steps at
lr 1e-2, where a fixed 1e-6 left 2.5e-3 out), and each such element must still pass step 3.

Where exactness itself is the point (the same gradients, one layout; a resumed run on the same machine and
layout), compare bitwise or with SGD instead: this rule is only for two orders of summing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

NOISE_FLOOR = 1e3  # a gradient below this many eps_float32 of its tensor's largest is float noise
R_MAX = 1e-2  # a gradient whose layouts differ by more than this, relative, is not resolved
R_FREE = 1e-3  # without gradients: weights within atol + R_FREE x AdamW's largest move count as resolved
EPS32 = torch.finfo(torch.float32).eps


def adam_ratio_bounds(steps: int, betas: tuple[float, float]) -> list[float]:
    """B_t for t = 1..steps: the most |m-hat_t| / sqrt(v-hat_t) can be for any gradients (Cauchy-Schwarz)."""
    b1, b2 = betas
    out = []
    for t in range(1, steps + 1):
        a = [(1 - b1) * b1 ** (t - s) / (1 - b1**t) for s in range(1, t + 1)]
        b = [(1 - b2) * b2 ** (t - s) / (1 - b2**t) for s in range(1, t + 1)]
        out.append(math.sqrt(sum(x * x / y for x, y in zip(a, b))))
    return out


def gradient_agreement(
    grads_a: Sequence[torch.Tensor], grads_b: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(resolved, r) per element: r is the largest relative difference of its gradients over the steps (0 where
    bit-identical); resolved where every step's gradient is bit-identical on both layouts, or above the noise
    floor NOISE_FLOOR x eps_float32 x max|g| of its tensor on both with r <= R_MAX."""
    ok = torch.ones_like(grads_a[0], dtype=torch.bool)
    r = torch.zeros_like(grads_a[0], dtype=torch.float64)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        ga, gb = ga.double(), gb.double()
        same = ga == gb
        scale = float(torch.maximum(ga.abs().max(), gb.abs().max())) if ga.numel() else 0.0
        small = torch.minimum(ga.abs(), gb.abs())
        rel = torch.where(same, torch.zeros_like(ga), (ga - gb).abs() / small.clamp(min=1e-300))
        r = torch.maximum(r, rel)
        ok &= same | ((small > NOISE_FLOOR * EPS32 * scale) & (rel <= R_MAX))
    return ok, r


def assert_adam_updates_close(
    before: Mapping[str, torch.Tensor],
    after_a: Mapping[str, torch.Tensor],
    after_b: Mapping[str, torch.Tensor],
    *,
    lrs: Sequence[float],
    grads_a: Sequence[Mapping[str, torch.Tensor]] | None = None,
    grads_b: Sequence[Mapping[str, torch.Tensor]] | None = None,
    betas: tuple[float, float] = (0.9, 0.95),
    first_step: int = 1,
    weight_decay: float = 0.0,
    atol: float = 1e-6,
    grad_rtol: float = 1e-4,
    grad_atol: float = 1e-7,
    min_resolved: float = 0.95,
    max_unresolved: float = 1e-3,
    msg: str = "",
) -> dict[str, int]:
    """Weights after len(lrs) AdamW steps on two layouts agree by the module's rule; returns the counts.

    `before`: the common starting weights; `after_a`/`after_b`: each layout's weights after the steps;
    `lrs`: the learning rate of each step (the first is AdamW's step `first_step`: 3 after a restored
    checkpoint of two steps; for several phases, each with a fresh AdamW, their lrs in a row: B_t grows with
    t, so the bound stays safe); `grads_a`/`grads_b`: each layout's gradients as AdamW saw them
    (after clipping), one mapping per step (see `record_grads`), or both None for the gradient-free form.
    A name missing from the gradients (a buffer, a frozen parameter) must not have moved on either side.
    """
    assert after_a.keys() == after_b.keys(), f"{msg}: different names"
    with_grads = grads_a is not None and grads_b is not None
    if with_grads:
        assert len(grads_a) == len(grads_b) == len(lrs) >= 1, f"{msg}: one gradient mapping per step"
        for step, (ga, gb) in enumerate(zip(grads_a, grads_b)):
            assert ga.keys() == gb.keys(), f"{msg}: step {step}: different gradient names"
            for name in ga:
                torch.testing.assert_close(
                    gb[name], ga[name], rtol=grad_rtol, atol=grad_atol, msg=f"{msg} step {step} grad {name}"
                )
    bounds = adam_ratio_bounds(first_step + len(lrs) - 1, betas)[first_step - 1 :]
    moved = sum(lr * b for lr, b in zip(lrs, bounds))
    total = resolved = 0
    for name, wa in after_a.items():
        wa, wb, w0 = wa.detach().double(), after_b[name].detach().double(), before[name].detach().double()
        if with_grads and name not in grads_a[0]:
            if _alias(name, after_a, after_b, grads_a[0]):
                continue  # a tied weight (lm_head = embed_tokens): compared under the name that has gradients
            torch.testing.assert_close(wa, w0, rtol=0, atol=0, msg=f"{msg} {name} (no gradient) moved")
            torch.testing.assert_close(wb, w0, rtol=0, atol=0, msg=f"{msg} {name} (no gradient) moved")
            continue
        if with_grads:
            ok, r = gradient_agreement([g[name] for g in grads_a], [g[name] for g in grads_b])
            ok, tol = ok.reshape(wa.shape), atol + 2.0 * moved * r.reshape(wa.shape)
        else:
            tol = torch.full_like(wa, atol + R_FREE * moved)
            ok = (wa - wb).abs() <= tol
        total += wa.numel()
        resolved += int(ok.sum())
        bad = ok & ((wa - wb).abs() > tol)
        if bad.any():
            i = int(bad.flatten().nonzero()[0])
            raise AssertionError(
                f"{msg} {name}: {int(bad.sum())} resolved element(s) differ by more than their tolerance, "
                f"e.g. flat index {i}: {wa.flatten()[i]:.8e} vs {wb.flatten()[i]:.8e} "
                f"(tolerance {tol.flatten()[i]:.2e})"
            )
        limit = sum(lr * (b + weight_decay * float(w0.abs().max())) for lr, b in zip(lrs, bounds))
        limit = limit * (1 + 1e-4) + atol
        for side, w in (("a", wa), ("b", wb)):
            far = ~ok & ((w - w0).abs() > limit)
            if far.any():
                i = int(far.flatten().nonzero()[0])
                raise AssertionError(
                    f"{msg} {name}: layout {side} moved a noise-dominated element by "
                    f"{float((w - w0).flatten()[i]):.3e}, more than AdamW's bound {limit:.3e}"
                )
    assert total > 0, f"{msg}: nothing compared"
    unresolved = total - resolved
    if with_grads:
        assert resolved >= min_resolved * total, (
            f"{msg}: only {resolved}/{total} elements have gradients above their noise: the comparison "
            "would say little"
        )
    else:
        assert unresolved <= max_unresolved * total, (
            f"{msg}: {unresolved}/{total} elements differ by more than {atol:.0e} (at most "
            f"{max_unresolved:.0e} of them may be noise-dominated)"
        )
    return {"elements": total, "resolved": resolved, "unresolved": unresolved}


def _alias(name: str, after_a: Mapping, after_b: Mapping, graded: Mapping) -> bool:
    """Whether `name` holds the same tensor as a name that has gradients, on both layouts (tied weights)."""
    return any(
        after_a[n].shape == after_a[name].shape
        and torch.equal(after_a[n], after_a[name])
        and torch.equal(after_b[n], after_b[name])
        for n in graded
        if n in after_a
    )


class Recorded:
    """Each optimizer step's whole gradients (as AdamW sees them: after clipping) and learning rate."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.lrs: list[float] = []
        self._model = model
        self.hook = optimizer.register_step_pre_hook(self._snapshot)

    def _snapshot(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        named = self._model.named_parameters()
        self.grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


def record_grads(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Recorded:
    """Start recording `model`'s gradients and the learning rate at each step of `optimizer` (one process)."""
    return Recorded(optimizer, model)
