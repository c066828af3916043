"""The rule of tests/numerics.py on synthetic AdamW runs: it holds under float noise that a fixed atol does
not, and still fails on a wrong gradient, a wrong learning rate and a noise-dominated element moved too far."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import adam_ratio_bounds, assert_adam_updates_close

LR, STEPS, BETAS = 1e-3, 3, (0.9, 0.95)


def _true_grads(step: int) -> dict[str, torch.Tensor]:
    """Per-step gradients of two tensors; a quarter of `w`'s elements have a true gradient of exactly 0 and a
    few of `b`'s sit near AdamW's eps (1e-8), where it is most sensitive."""
    g = torch.Generator().manual_seed(step)
    w = torch.randn(64, 16, generator=g) * 1e-2
    w[:16] = 0.0
    b = torch.randn(32, generator=g) * 1e-3
    b[:4] = 7e-9
    return {"w": w, "b": b}


def _noisy(grads: dict[str, torch.Tensor], seed: int, rel: float) -> dict[str, torch.Tensor]:
    """What another reduction order gives: every element off by `rel` x its tensor's largest gradient."""
    g = torch.Generator().manual_seed(100 + seed)
    return {n: t + rel * float(t.abs().max()) * torch.randn(t.shape, generator=g) for n, t in grads.items()}


def _adamw(start: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], lrs: list[float]) -> dict:
    params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    opt = torch.optim.AdamW(params.values(), lr=lrs[0], betas=BETAS, weight_decay=0.0)
    for lr, step in zip(lrs, grads):
        for group in opt.param_groups:
            group["lr"] = lr
        for n, p in params.items():
            p.grad = step[n].clone()
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


@pytest.fixture(scope="module")
def run() -> dict:
    start = {"w": torch.randn(64, 16, generator=torch.Generator().manual_seed(0)), "b": torch.zeros(32)}
    exact = [_true_grads(s) for s in range(STEPS)]
    noisy = [_noisy(g, s, 1e-7) for s, g in enumerate(exact)]  # eps_float32-sized noise
    return {"start": start, "exact": exact, "noisy": noisy, "a": _adamw(start, exact, [LR] * STEPS)}


def test_float_noise_passes_the_rule_where_a_fixed_tolerance_fails(run):
    b = _adamw(run["start"], run["noisy"], [LR] * STEPS)
    with pytest.raises(AssertionError):  # the problem: AdamW turns the zero gradients' noise into ~lr moves
        for name in b:
            torch.testing.assert_close(b[name], run["a"][name], rtol=0, atol=1e-6)
    counts = assert_adam_updates_close(
        run["start"],
        run["a"],
        b,
        lrs=[LR] * STEPS,
        grads_a=run["exact"],
        grads_b=run["noisy"],
        min_resolved=0.7,
    )
    assert counts["unresolved"] >= 16 * 16  # the zero rows at least
    # 1e-9 relative noise on the zero-gradient elements alone: the same
    tiny = [{n: t.clone() for n, t in g.items()} for g in run["exact"]]
    for step in tiny:
        step["w"][:16] = 1e-9 * torch.randn(16, 16)
    assert_adam_updates_close(
        run["start"], run["a"], _adamw(run["start"], tiny, [LR] * STEPS),
        lrs=[LR] * STEPS, grads_a=run["exact"], grads_b=tiny, min_resolved=0.7,
    )  # fmt: skip


def test_a_wrong_gradient_fails(run):
    bug = [{**g, "w": g["w"] * (1 + 1e-3)} for g in run["noisy"]]  # a 1e-3 relative error in one tensor
    b = _adamw(run["start"], bug, [LR] * STEPS)
    with pytest.raises(AssertionError, match="grad w"):
        assert_adam_updates_close(
            run["start"], run["a"], b, lrs=[LR] * STEPS, grads_a=run["exact"], grads_b=bug, min_resolved=0.7
        )


@pytest.mark.parametrize("with_grads", [True, False])
def test_a_wrong_learning_rate_fails(run, with_grads):
    b = _adamw(run["start"], run["noisy"], [LR, LR * 1.01, LR])  # one step at a 1% wrong lr
    grads = {"grads_a": run["exact"], "grads_b": run["noisy"]} if with_grads else {}
    with pytest.raises(AssertionError, match="differ|bound"):
        assert_adam_updates_close(run["start"], run["a"], b, lrs=[LR] * STEPS, min_resolved=0.7, **grads)


def test_a_noise_dominated_element_moved_past_adams_bound_fails(run):
    b = _adamw(run["start"], run["noisy"], [LR] * STEPS)
    b["w"][0, 0] += 3 * LR * STEPS
    with pytest.raises(AssertionError, match="AdamW's bound"):
        assert_adam_updates_close(
            run["start"],
            run["a"],
            b,
            lrs=[LR] * STEPS,
            grads_a=run["exact"],
            grads_b=run["noisy"],
            min_resolved=0.7,
        )


def test_the_rule_says_little_when_most_gradients_are_noise(run):
    b = _adamw(run["start"], run["noisy"], [LR] * STEPS)
    with pytest.raises(AssertionError, match="above their noise"):
        assert_adam_updates_close(
            run["start"],
            run["a"],
            b,
            lrs=[LR] * STEPS,
            grads_a=run["exact"],
            grads_b=run["noisy"],
            min_resolved=0.99,
        )


def test_adams_bound_is_one_at_the_first_step_and_holds_for_any_gradients():
    bounds = adam_ratio_bounds(5, BETAS)
    assert bounds[0] == pytest.approx(1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # the worst of random sign patterns and scales stays under the bound
        grads = torch.randn(5, generator=g) * torch.logspace(-3, 3, 5)[torch.randperm(5, generator=g)]
        m = v = 0.0
        for t, x in enumerate(grads.tolist(), 1):
            m, v = BETAS[0] * m + (1 - BETAS[0]) * x, BETAS[1] * v + (1 - BETAS[1]) * x * x
            ratio = abs(m / (1 - BETAS[0] ** t)) / (v / (1 - BETAS[1] ** t)) ** 0.5
            assert ratio <= bounds[t - 1] + 1e-9
