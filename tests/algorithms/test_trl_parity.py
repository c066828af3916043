"""Parity with TRL (optional): the same random inputs through TRL's trainer code and through ours, float64.

TRL keeps its losses inside trainer methods (GRPOTrainer._compute_loss, DPOTrainer._compute_loss,
RewardTrainer.compute_loss) rather than in free functions. We call those methods unbound on a minimal
stand-in `self` that carries only the attributes the loss code reads, and a stand-in model whose forward
returns the log-probs (or rewards) we chose, so no model, tokenizer or Accelerator is built.
Written against TRL 1.16.0: a TRL release that renames those attributes breaks the stand-in, not us.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import need_module

# Under LOOPLINE_STRICT_SKIPS=1 (CI) a missing TRL fails this module instead of skipping it.
trl = need_module("trl", "parity tests need TRL (pip install loopline[parity])")
from trl import DPOTrainer, GRPOTrainer, RewardTrainer  # noqa: E402

from loopline.algorithms.losses import aggregate, clipped_policy_loss, gspo_policy_loss, kl_estimate  # noqa: E402
from loopline.algorithms.preference import (  # noqa: E402
    bradley_terry_loss,
    dpo_hinge_loss,
    dpo_ipo_loss,
    dpo_robust_loss,
    dpo_sigmoid_loss,
)

F64 = torch.float64
TOL = dict(atol=1e-6, rtol=0.0)


class _Accelerator:
    """Single process: every gather and reduce is the identity."""

    num_processes = 1
    device = torch.device("cpu")

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _metrics() -> dict:
    return {"train": defaultdict(list), "eval": defaultdict(list)}


# ---------------------------------------------------------------- GRPO family

B, T, MAX_LEN = 8, 12, 14


def _rollout(seed: int) -> dict[str, torch.Tensor]:
    """Random log-probs far enough apart that both clip sides fire; one empty row, one full row."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3.0
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    behaviour = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.tensor([3, 12, 0, 5, 1, 9, 11, 7])
    mask = (torch.arange(T) < lengths.unsqueeze(1)).to(F64)  # (B, T)
    mask[3, 1] = 0.0  # a hole (tool output) inside a response
    adv = torch.randn(B, generator=g, dtype=F64)
    return {"old": old, "logp": logp, "ref": ref, "behaviour": behaviour, "mask": mask, "adv": adv}


def _assert_both_clip_sides_fire(d: dict[str, torch.Tensor], lo: float, hi: float) -> None:
    """The inputs reach every branch: inside, above 1 + hi with A > 0, below 1 - lo with A < 0, and
    (for clip-higher) the band (1 + lo, 1 + hi] where the symmetric and asymmetric clips differ."""
    ratio = torch.exp(d["logp"] - d["old"])
    on = d["mask"].bool()
    pos, neg = (d["adv"] > 0).unsqueeze(1) & on, (d["adv"] < 0).unsqueeze(1) & on
    assert (pos & (ratio > 1 + hi)).any() and (neg & (ratio < 1 - lo)).any()
    assert (on & (ratio > 1 - lo) & (ratio < 1 + lo)).any()
    if hi > lo:
        assert (pos & (ratio > 1 + lo) & (ratio <= 1 + hi)).any()


def _trl_grpo_loss(
    logp: torch.Tensor,
    d: dict[str, torch.Tensor],
    loss_type: str,
    beta: float,
    eps_low: float,
    eps_high: float,
    level: str = "token",
    delta: float | None = None,
    is_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPOTrainer._compute_loss on a stand-in self whose log-prob method returns `logp`."""
    me = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN,
        _entropy_bonus_enabled=False,
        _metrics=_metrics(),
        accelerator=_Accelerator(),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": d["mask"],
        "advantages": d["adv"],
        "old_per_token_logps": d["old"],
        "ref_per_token_logps": d["ref"],
        "num_items_in_batch": d["mask"].sum(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(me, None, inputs)


def _ours(logp, d, agg, beta, eps_low, eps_high, **kw) -> torch.Tensor:
    """The GRPO objective as loopline's trainer composes it: policy loss + beta * aggregated k3 KL."""
    pg = clipped_policy_loss(logp, d["old"], d["adv"], d["mask"], eps_low, eps_high, agg, MAX_LEN, **kw)
    return pg.loss + beta * aggregate(kl_estimate(logp, d["ref"], "k3"), d["mask"], agg, MAX_LEN)


def _check(ours_fn, trl_fn, d) -> None:
    """Same loss value and the same gradient with respect to the policy log-probs."""
    a = d["logp"].clone().requires_grad_(True)
    b = d["logp"].clone().requires_grad_(True)
    ours, theirs = ours_fn(a), trl_fn(b)
    torch.testing.assert_close(ours, theirs, **TOL)
    (ga,) = torch.autograd.grad(ours, a)
    (gb,) = torch.autograd.grad(theirs, b)
    torch.testing.assert_close(ga, gb, **TOL)


# TRL loss_type -> our aggregation; "dapo" with one process, one accumulation step and
# steps_per_generation 1 normalises by the batch's active tokens, i.e. token_mean.
LOSS_TYPES = [
    ("grpo", "seq_mean"),
    ("bnpo", "token_mean"),
    ("dr_grpo", "fixed_length"),
    ("dapo", "token_mean"),
]


@pytest.mark.parametrize("loss_type,agg", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)], ids=["symmetric", "clip-higher"])
def test_grpo_loss_matches_trl(loss_type, agg, beta, clip):
    d = _rollout(seed=1)  # a seed whose ratios reach every branch (checked below)
    lo, hi = clip
    _assert_both_clip_sides_fire(d, lo, hi)
    _check(
        lambda lp: _ours(lp, d, agg, beta, lo, hi),
        lambda lp: _trl_grpo_loss(lp, d, loss_type, beta, lo, hi),
        d,
    )


@pytest.mark.parametrize("loss_type,agg", LOSS_TYPES[:3])
def test_dual_clip_matches_trl_delta(loss_type, agg):
    # TRL's `delta` caps the unclipped ratio at delta; with delta > 1 + eps_high that only bites where A < 0,
    # where it gives -min(r A, clip(r) A) capped at -delta A: our dual clip with c = delta.
    d = _rollout(seed=7)
    d["logp"] = d["old"] + 2.0 * (d["logp"] - d["old"])  # spread ratios so some pass 1.5
    ratio = torch.exp(d["logp"] - d["old"])
    assert ((d["adv"] < 0).unsqueeze(1) & d["mask"].bool() & (ratio > 1.5)).any()  # the cap bites
    _check(
        lambda lp: _ours(lp, d, agg, 0.04, 0.2, 0.2, dual_clip=1.5),
        lambda lp: _trl_grpo_loss(lp, d, loss_type, 0.04, 0.2, 0.2, delta=1.5),
        d,
    )


@pytest.mark.parametrize("loss_type,agg", [("grpo", "seq_mean"), ("bnpo", "token_mean")])
def test_gspo_matches_trl_sequence_level(loss_type, agg):
    d = _rollout(seed=11)
    lo, hi = 3e-3, 4e-3
    m = d["mask"]
    seq_ratio = torch.exp(((d["logp"] - d["old"]) * m).sum(1) / m.sum(1).clamp(min=1.0))
    assert ((seq_ratio - 1).abs() > hi).any() and ((seq_ratio - 1).abs() < lo).any()  # clipped and not

    def ours(lp):
        pg = gspo_policy_loss(lp, d["old"], d["adv"], d["mask"], lo, hi, agg, MAX_LEN)
        return pg.loss + 0.04 * aggregate(kl_estimate(lp, d["ref"], "k3"), d["mask"], agg, MAX_LEN)

    _check(ours, lambda lp: _trl_grpo_loss(lp, d, loss_type, 0.04, lo, hi, level="sequence"), d)


def test_truncated_is_weights_enter_the_loss_as_trl_applies_them():
    # TRL builds the ratio inside its generation step (not callable alone); here both sides get the same
    # weights and must apply them the same way: on the policy term, before aggregation, not on the KL.
    from loopline.algorithms.losses import truncated_is_weights

    d = _rollout(seed=5)
    w = truncated_is_weights(d["old"], d["behaviour"], d["mask"], cap=1.2)
    _check(
        lambda lp: _ours(lp, d, "token_mean", 0.04, 0.2, 0.2, is_weights=w),
        lambda lp: _trl_grpo_loss(lp, d, "bnpo", 0.04, 0.2, 0.2, is_ratio=w),
        d,
    )


# ---------------------------------------------------------------- DPO


def _pairs(seed: int, n: int = 5) -> dict[str, torch.Tensor]:
    """Per-token log-probs of chosen and rejected completions under a padded (2n, L) completion mask."""
    g = torch.Generator().manual_seed(seed)
    length = 8
    lengths = torch.randint(1, length, (2 * n,), generator=g)
    lengths[0] = length - 1  # one completion fills the row
    shifted = (torch.arange(length - 1) < lengths.unsqueeze(1)).to(
        F64
    )  # (2n, L-1) mask of the predicted tokens
    per_token = -torch.rand(2 * n, length - 1, generator=g, dtype=F64) * 2.0 * shifted
    ref = per_token.sum(1) + 0.5 * torch.randn(2 * n, generator=g, dtype=F64)
    completion_mask = torch.cat([torch.zeros(2 * n, 1, dtype=F64), shifted], dim=1)  # (2n, L)
    return {"per_token": per_token, "ref": ref, "completion_mask": completion_mask, "lengths": lengths}


def _trl_dpo_loss(per_token: torch.Tensor, d: dict, loss_type: str, beta: float, label_smoothing: float):
    """DPOTrainer._compute_loss with precomputed reference log-probs and a model that returns `per_token`."""
    rows = per_token.shape[0]
    model = lambda **kw: SimpleNamespace(  # noqa: E731
        log_probs=per_token,
        entropy=torch.zeros_like(per_token),
        mean_logits=torch.zeros_like(per_token),
        is_top1=torch.zeros_like(per_token, dtype=torch.bool),
    )
    me = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics=_metrics(),
        _total_train_tokens=0,
        _tp_size=1,
    )
    c_ref, r_ref = d["ref"].chunk(2)
    inputs = {
        "input_ids": torch.zeros(rows, per_token.shape[1] + 1, dtype=torch.long),
        "attention_mask": torch.ones(rows, per_token.shape[1] + 1, dtype=torch.long),
        "completion_mask": d["completion_mask"].long(),
        "ref_chosen_logps": c_ref,
        "ref_rejected_logps": r_ref,
    }
    return DPOTrainer._compute_loss(me, model, inputs, return_outputs=False)


def _our_dpo(per_token: torch.Tensor, d: dict, loss_type: str, beta: float, label_smoothing: float):
    pc, pr = per_token.sum(1).chunk(2)
    rc, rr = d["ref"].chunk(2)
    if loss_type == "sigmoid":
        return dpo_sigmoid_loss(pc, pr, rc, rr, beta).loss
    if loss_type == "hinge":
        return dpo_hinge_loss(pc, pr, rc, rr, beta).loss
    if loss_type == "robust":
        return dpo_robust_loss(pc, pr, rc, rr, beta, label_smoothing).loss
    lc, lr = d["lengths"].chunk(2)
    return dpo_ipo_loss(pc, pr, rc, rr, lc, lr, beta).loss


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_losses_match_trl(loss_type, beta):
    d = _pairs(seed=3)
    a = d["per_token"].clone().requires_grad_(True)
    b = d["per_token"].clone().requires_grad_(True)
    ours = _our_dpo(a, d, loss_type, beta, 0.1)
    theirs = _trl_dpo_loss(b, d, loss_type, beta, 0.1)
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(torch.autograd.grad(ours, a)[0], torch.autograd.grad(theirs, b)[0], **TOL)


# ---------------------------------------------------------------- reward model


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_bradley_terry_matches_trl(with_margin, center):
    g = torch.Generator().manual_seed(1)
    n = 6
    rewards = torch.randn(
        2 * n, 1, generator=g, dtype=F64
    )  # chosen rows first, as TRL's collator stacks them
    margin = torch.rand(n, generator=g, dtype=F64)
    me = SimpleNamespace(
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(center_rewards_coefficient=center),
        accelerator=_Accelerator(),
        _metrics=_metrics(),
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {"input_ids": torch.zeros(2 * n, 3, dtype=torch.long), "attention_mask": torch.ones(2 * n, 3)}
    if with_margin:
        inputs["margin"] = margin
    theirs = RewardTrainer.compute_loss(me, lambda **kw: SimpleNamespace(logits=rewards), inputs)
    chosen, rejected = rewards.squeeze(-1).chunk(2)
    ours = bradley_terry_loss(chosen, rejected, margin if with_margin else None, center or 0.0)
    torch.testing.assert_close(ours, theirs, **TOL)
