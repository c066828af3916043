"""The trainers' update steps pinned to hand-computed losses, on a model whose every log-prob is known.

`TableLM` gives the next-token logits as a (V, V) table indexed by the current token, so log-probs and
entropies are exact fractions. Each step (GRPO with KL in the loss and the entropy bonus, SFT, DPO, the
critic's clipped value loss, the reward model's Bradley-Terry loss) runs through the trainer's own
selection path and micro-batching; the reported loss must equal the value worked out in the comments,
the same with 1 or 2 rows per micro-batch, and the gradient must be that of the pinned formula.

The batch (pad 0, prompt [1], so P = 1; responses right-padded to C = 2):
    row 0: [1 | 2, 2]    row 1: [1 | 1, pad]
Table (next-token distribution given the current token):
    after 1: p = [1/4, 1/2, 1/4] (logits [0, ln 2, 0]), entropy H1 = 1.5 ln 2
    after 2: p = [1/3, 1/3, 1/3] (logits 0),            entropy H2 = ln 3
Response log-probs: row 0 [ln p(2|1), ln p(2|2)] = [ln 1/4, ln 1/3]; row 1 [ln p(1|1)] = [ln 1/2]
Entropies at the response positions: row 0 [H1, H2], row 1 [H1].
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from loopline.config import (
    CriticConfig,
    DPOConfig,
    GRPOConfig,
    OptimConfig,
    RewardModelConfig,
    SamplingConfig,
)
from loopline.data.batches import RolloutBatch, TokenBatch, collate
from loopline.data.preference import PairBatch
from loopline.training.critic import CriticTrainer, RewardTrainer, ScalarModel, ValueBatch
from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs, sequence_logprobs

LN2, LN3 = math.log(2.0), math.log(3.0)
H1, H2 = 1.5 * LN2, LN3
LOGP = torch.tensor([[math.log(1 / 4), math.log(1 / 3)], [math.log(1 / 2), math.log(1 / 4)]])  # (2, 2)
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1e6)


def _table() -> torch.Tensor:
    table = torch.zeros(3, 3)
    table[1, 1] = LN2
    return table


class TableLM(torch.nn.Module):
    """A causal LM whose logits at position t are row input_ids[t] of a trainable (V, V) table."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(_table())

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return SimpleNamespace(logits=self.table[input_ids])


def _tokens() -> TokenBatch:
    batch = collate([[1], [1]], [[2, 2], [1]], pad_id=0)
    assert (
        batch.input_ids.tolist() == [[1, 2, 2], [1, 1, 0]] and batch.response_mask.tolist() == MASK.tolist()
    )
    return batch


def _reference_grad_norm(loss_of_logits) -> float:
    """Grad norm of a pinned loss written directly over the table (one batch, no micro-batching)."""
    table = _table().requires_grad_(True)
    ids = _tokens().input_ids
    logits = table[ids][:, :-1]  # (2, 2, 3): positions 0 and 1 predict response columns 0 and 1
    loss_of_logits(logits, ids[:, 1:]).backward()
    return float(table.grad.norm())


def _token_logp(logits, targets):
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, C)


def _entropy(logits):
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)  # (B, C)


def test_the_table_model_gives_the_log_probs_of_the_docstring():
    logp, entropy = response_logprobs(TableLM(), _tokens(), with_entropy=True)
    torch.testing.assert_close(logp, LOGP)
    torch.testing.assert_close(entropy, torch.tensor([[H1, H2], [H1, H1]]))
    # summed over the response mask: ln 1/12 and ln 1/2
    torch.testing.assert_close(sequence_logprobs(TableLM(), _tokens()), torch.tensor([-math.log(12), -LN2]))


# ---------------------------------------------------------------- GRPO: policy_step
#
# On-policy (old log-probs None): ratio 1, so the clipped surrogate is -A per token. A = [1, -0.5]:
#   per-token policy loss row 0 [-1, -1], row 1 [0.5]
#   token_mean -1.5 / 3 = -0.5;  seq_mean mean(-1, 0.5) = -0.25;  fixed_length (max_new_tokens 4) -1.5 / 8
# KL in the loss against ref = logp - d, d = row 0 [0.2, 0.4], row 1 [0.6]:
#   k1 = logp - ref = d:              token_mean 1.2 / 3 = 0.4
#   k2 = 0.5 d^2 = [.02, .08], [.18]: seq_mean mean(0.05, 0.18) = 0.115
#   k3 = exp(-d) - 1 + d:             fixed_length sum / 8
# Entropy bonus aggregated like the loss: token_mean (2 H1 + H2) / 3; seq_mean mean((H1 + H2) / 2, H1).
# loss = policy - entropy_coef * bonus + kl_coef * kl; the logged entropy is always the token mean.

D = torch.tensor([[0.2, 0.4], [0.6, 9.0]])
ADV = torch.tensor([1.0, -0.5])


def _k3(d: float) -> float:
    return math.exp(-d) - 1 + d


GRPO_CASES = {
    "token_mean-k1": (
        {"loss_agg": "token_mean", "kl_estimator": "k1", "kl_coef": 0.1, "entropy_coef": 0.01},
        {"policy_loss": -0.5, "kl": 0.4, "bonus": (2 * H1 + H2) / 3},
    ),
    "seq_mean-k2": (
        {"loss_agg": "seq_mean", "kl_estimator": "k2", "kl_coef": 0.1, "entropy_coef": 0.01},
        {"policy_loss": -0.25, "kl": 0.115, "bonus": ((H1 + H2) / 2 + H1) / 2},
    ),
    "fixed_length-k3": (
        {"loss_agg": "fixed_length", "kl_estimator": "k3", "kl_coef": 0.2, "entropy_coef": 0.01},
        {"policy_loss": -1.5 / 8, "kl": (_k3(0.2) + _k3(0.4) + _k3(0.6)) / 8, "bonus": (2 * H1 + H2) / 8},
    ),
    "no-kl-coef": (  # reference log-probs present but kl_coef 0 (KL in the reward): no KL term, kl logged 0
        {"loss_agg": "token_mean", "kl_estimator": "k1", "kl_coef": 0.0, "entropy_coef": 0.0},
        {"policy_loss": -0.5, "kl": 0.0, "bonus": 0.0},
    ),
}


def _grpo_reference(fields: dict):
    """The pinned GRPO objective written out over the whole batch."""

    def loss(logits, targets):
        logp = _token_logp(logits, targets)
        per_token = -ADV[:, None] * torch.exp(logp - logp.detach())  # ratio 1, gradient of r A
        d = logp - (LOGP - D)  # = D in value, differentiable in logp
        kl = {"k1": d, "k2": 0.5 * d.square(), "k3": torch.exp(-d) - 1 + d}[fields["kl_estimator"]]
        terms = per_token + fields["kl_coef"] * kl - fields["entropy_coef"] * _entropy(logits)
        if fields["loss_agg"] == "token_mean":
            return (terms * MASK).sum() / MASK.sum()
        if fields["loss_agg"] == "seq_mean":
            return ((terms * MASK).sum(1) / MASK.sum(1)).mean()
        return (terms * MASK).sum() / (2 * 4)

    return loss


def _policy_trainer(cfg: GRPOConfig) -> PolicyTrainer:
    """A trainer of TableLM for an RL phase under `cfg`: its objective built once, as the loop builds it."""
    return PolicyTrainer(TableLM(), OPTIM, 1, loss=grpo_loss(cfg), micro_batch_size=cfg.micro_batch_size)


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("case", sorted(GRPO_CASES))
def test_grpo_step_loss_kl_entropy_pinned(case, micro):
    fields, want = GRPO_CASES[case]
    cfg = GRPOConfig(micro_batch_size=micro, sampling=SamplingConfig(max_new_tokens=4), **fields)
    t = _tokens()
    batch = RolloutBatch(
        t.input_ids, t.attention_mask, t.response_mask, old_logprobs=None, ref_logprobs=LOGP - D,
        advantages=ADV, rewards=torch.zeros(2),
    )  # fmt: skip
    stats = _policy_trainer(cfg).policy_step(batch, cfg.kl_coef)
    expected = want["policy_loss"] + fields["kl_coef"] * want["kl"] - fields["entropy_coef"] * want["bonus"]
    assert stats.loss == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert stats.extra["policy_loss"] == pytest.approx(want["policy_loss"], rel=1e-5)
    assert stats.extra["kl"] == pytest.approx(want["kl"], rel=1e-5)
    assert stats.extra["entropy"] == pytest.approx((2 * H1 + H2) / 3, rel=1e-5)
    assert stats.extra["clip_fraction"] == 0.0 and stats.extra["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert stats.grad_norm == pytest.approx(_reference_grad_norm(_grpo_reference(fields)), rel=1e-4)
    assert stats.lr == OPTIM.lr


def test_grpo_step_on_a_single_token():
    # row 1 alone (one token, A = -0.5), token_mean: the loss is -A = 0.5, divided by one token
    t = _tokens()
    batch = RolloutBatch(
        t.input_ids[1:], t.attention_mask[1:], t.response_mask[1:], old_logprobs=None, ref_logprobs=None,
        advantages=ADV[1:], rewards=torch.zeros(1),
    )  # fmt: skip
    stats = _policy_trainer(GRPOConfig()).policy_step(batch, kl_coef=0.0)
    assert stats.loss == pytest.approx(0.5)


def test_response_logprobs_without_entropy_returns_none():
    assert response_logprobs(TableLM(), _tokens())[1] is None


# Off-policy, clip-higher and dual clip: old = logp - ln r with r = row 0 [1.5, 0.9], row 1 [5, 3 (masked)],
# A = [1, -1], clip_low 0.2, clip_high 0.28, dual clip 3:
#   row 0: -min(1.5, 1.28) = -1.28 (clipped away), -min(0.9, 0.9) = -0.9;  row 1: min(-min(-5, -1.2), 3) = 3
#   token_mean (-1.28 - 0.9 + 3) / 3 = 0.82 / 3; clip_fraction 1/3 (the dual cap is not the ratio clip)
#   approx_kl = mean of (r - 1 - ln r) over the 3 tokens
@pytest.mark.parametrize("micro", [1, 2])
def test_grpo_step_off_policy_clip_higher_and_dual_clip(micro):
    ratio = torch.tensor([[1.5, 0.9], [5.0, 3.0]])
    cfg = GRPOConfig(micro_batch_size=micro, clip_high=0.28, dual_clip=3.0)
    t = _tokens()
    batch = RolloutBatch(
        t.input_ids, t.attention_mask, t.response_mask, old_logprobs=LOGP - ratio.log(), ref_logprobs=None,
        advantages=torch.tensor([1.0, -1.0]), rewards=torch.zeros(2),
    )  # fmt: skip
    stats = _policy_trainer(cfg).policy_step(batch, cfg.kl_coef)
    assert stats.loss == pytest.approx(0.82 / 3, rel=1e-5)
    assert stats.extra["clip_fraction"] == pytest.approx(1 / 3)
    approx = sum(r - 1 - math.log(r) for r in (1.5, 0.9, 5.0)) / 3
    assert stats.extra["approx_kl"] == pytest.approx(approx, rel=1e-5)
    # only row 0's second token is inside the clip: d/dtable of (0.9 * exp(logp - logp_t)) * 1 / 3 tokens
    assert stats.grad_norm == pytest.approx(
        _reference_grad_norm(lambda lg, tg: -0.9 * torch.exp(_token_logp(lg, tg)[0, 1] - LOGP[0, 1]) / 3),
        rel=1e-4,
    )


# ---------------------------------------------------------------- SFT: token-mean NLL of the response tokens
# -(ln 1/4 + ln 1/3 + ln 1/2) / 3 = ln 24 / 3


@pytest.mark.parametrize("micro", [1, 2])
def test_sft_step_pinned(micro):
    stats = PolicyTrainer(TableLM(), OPTIM, total_steps=1).sft_step(_tokens(), micro)
    assert stats.loss == pytest.approx(math.log(24) / 3, rel=1e-6)
    ref = _reference_grad_norm(lambda lg, tg: -(_token_logp(lg, tg) * MASK).sum() / 3)
    assert stats.grad_norm == pytest.approx(ref, rel=1e-4)
    assert stats.lr == OPTIM.lr and stats.extra == {}


# ---------------------------------------------------------------- DPO: dpo_step through DPO_LOSSES[cfg.loss]
#
# pair 1: chosen [2, 2] (logp ln 1/12, 2 tokens), rejected [1] (ln 1/2, 1 token)
# pair 2: chosen [1] (ln 1/2, 1 token),           rejected [2, 2] (ln 1/12, 2 tokens)
# references: pair 1 chosen ln 1/12 - 1, rejected ln 1/2 + 1      -> log-ratios +1 / -1,     delta = 2
#             pair 2 chosen ln 1/2 + 0.5, rejected ln 1/12 - 0.5 -> log-ratios -0.5 / +0.5, delta = -1
# beta 0.5, so x = beta * delta = [1, -0.5]:
#   sigmoid (cDPO, e = 0.1): mean of -(0.9) logsig(x) - 0.1 logsig(-x)
#   hinge:   mean(relu(1 - 1), relu(1 + 0.5)) = 0.75
#   ipo:     ((dc/|c| - dr/|r|) - 1/(2 beta))^2: pair 1 (1/2 + 1/1 - 1)^2 = 0.25,
#            pair 2 (-0.5/1 - 0.5/2 - 1)^2 = 1.75^2 = 3.0625 -> mean 1.65625
#   robust (e = 0.2): mean of [-(0.8) logsig(x) + 0.2 logsig(-x)] / 0.6
# chosen NLL (per-token mean, mean over pairs): (ln 12 / 2 + ln 2) / 2, weighted by nll_coef 0.1
# implicit rewards beta * log-ratio: chosen [0.5, -0.25], rejected [-0.5, 0.25]: accuracy 1/2,
#   margin mean(1, -0.5) = 0.25, chosen mean 0.125, rejected mean -0.125


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


DPO_CASES = {
    "sigmoid": sum(-0.9 * _logsig(x) - 0.1 * _logsig(-x) for x in (1.0, -0.5)) / 2,
    "hinge": 0.75,
    "ipo": 1.65625,
    "robust": sum((-0.8 * _logsig(x) + 0.2 * _logsig(-x)) / 0.6 for x in (1.0, -0.5)) / 2,
}


def _pairs() -> PairBatch:
    chosen = collate([[1], [1]], [[2, 2], [1]], pad_id=0)
    rejected = collate([[1], [1]], [[1], [2, 2]], pad_id=0)
    ln12 = math.log(12)
    return PairBatch(
        chosen, rejected, torch.zeros(2),
        ref_chosen=torch.tensor([-ln12 - 1, -LN2 + 0.5]), ref_rejected=torch.tensor([-LN2 + 1, -ln12 - 0.5]),
    )  # fmt: skip


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("loss", sorted(DPO_CASES))
def test_dpo_step_pinned(loss, micro):
    smoothing = {"sigmoid": 0.1, "robust": 0.2}.get(loss, 0.0)
    cfg = DPOConfig(loss=loss, beta=0.5, nll_coef=0.1, label_smoothing=smoothing, micro_batch_size=micro)
    stats = PolicyTrainer(TableLM(), OPTIM, total_steps=1).dpo_step(_pairs(), cfg)
    nll = (math.log(12) / 2 + LN2) / 2
    assert stats.pref_loss == pytest.approx(DPO_CASES[loss], rel=1e-5)
    assert stats.chosen_nll == pytest.approx(nll, rel=1e-5)
    assert stats.loss == pytest.approx(DPO_CASES[loss] + 0.1 * nll, rel=1e-5)
    assert stats.pref_accuracy == 0.5 and stats.reward_margin == pytest.approx(0.25)
    assert stats.chosen_reward == pytest.approx(0.125)
    assert stats.rejected_reward == pytest.approx(-0.125)
    # the metrics row's statistics between loss and grad_norm, in the row's order
    assert list(stats.extra) == [
        "pref_loss", "chosen_nll", "pref_accuracy", "reward_margin", "chosen_reward", "rejected_reward"
    ]  # fmt: skip


def test_dpo_step_gradient_and_lr_do_not_depend_on_micro_batching():
    cfg = DPOConfig(loss="sigmoid", beta=0.5, nll_coef=0.1, micro_batch_size=1)
    one = PolicyTrainer(TableLM(), OPTIM, total_steps=1).dpo_step(_pairs(), cfg)
    two = PolicyTrainer(TableLM(), OPTIM, total_steps=1).dpo_step(
        _pairs(), cfg.model_copy(update={"micro_batch_size": 2})
    )
    assert one.grad_norm == pytest.approx(two.grad_norm, rel=1e-5) and one.grad_norm > 0
    assert one.lr == two.lr == OPTIM.lr


def test_dpo_step_counts_a_tie_as_no_win():
    # references equal to the policy's own log-probs: both implicit rewards 0, accuracy 0, loss ln 2
    pairs = _pairs()
    pairs.ref_chosen = sequence_logprobs(TableLM(), pairs.chosen).detach()
    pairs.ref_rejected = sequence_logprobs(TableLM(), pairs.rejected).detach()
    stats = PolicyTrainer(TableLM(), OPTIM, total_steps=1).dpo_step(pairs, DPOConfig(nll_coef=0.0))
    assert stats.pref_accuracy == 0.0 and stats.loss == pytest.approx(math.log(2.0), rel=1e-6)


def test_dpo_step_needs_reference_log_probs():
    pairs = _pairs()
    pairs.ref_rejected = None
    with pytest.raises(
        ValueError, match=r"^dpo_step needs the pairs' reference log-probs \(ref_chosen, ref_rejected\)$"
    ):
        PolicyTrainer(TableLM(), OPTIM, total_steps=1).dpo_step(pairs, DPOConfig())


# ---------------------------------------------------------------- critic: CriticTrainer.step
#
# ScalarModel over a body whose hidden state is a 1-d embedding E = [0, 0.5, -0.5] of the token, head w = 1,
# b = 0. response_values reads positions P-1 .. L-2: row 0 tokens [1, 2] -> V = [0.5, -0.5]; row 1 [1, 1]
# -> [0.5, 0.5 (masked)]. returns R = row 0 [1, 2], row 1 [-1, 7]; old values row 0 [0.5, 0], row 1 [1, 0].
# clipped value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -0.2, 0.2) - R)^2), token mean:
#   row 0 t0: (0.5 - 1)^2 = 0.25;   V_old + clip(0)    = 0.5,  (0.5 - 1)^2  = 0.25 -> 0.125
#   row 0 t1: (-0.5 - 2)^2 = 6.25;  0 + clip(-0.5)     = -0.2, (-2.2)^2     = 4.84 -> 3.125
#   row 1 t0: (0.5 + 1)^2 = 2.25;   1 + clip(-0.5)     = 0.8,  (1.8)^2      = 3.24 -> 1.62 (clipped is larger)
#   loss (0.125 + 3.125 + 1.62) / 3 = 4.87 / 3, clip fraction 1/3, value mean (0.5 - 0.5 + 0.5) / 3 = 1/6
# unclipped (value_clip None): (0.125 + 3.125 + 1.125) / 3 = 4.375 / 3


class EmbedBody(torch.nn.Module):
    """A transformer body stand-in: last_hidden_state (B, L, 1) = a trainable embedding of each token."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.tensor(values)[:, None])

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return SimpleNamespace(last_hidden_state=self.embed[input_ids])


def _scalar_model(values: list[float], bias: float = 0.0) -> ScalarModel:
    model = ScalarModel(EmbedBody(values), hidden_size=1)
    with torch.no_grad():
        model.head.weight.fill_(1.0)
        model.head.bias.fill_(bias)
    return model


RETURNS = torch.tensor([[1.0, 2.0], [-1.0, 7.0]])
OLD_VALUES = torch.tensor([[0.5, 0.0], [1.0, 0.0]])


def _value_batch(rows: list[int]) -> ValueBatch:
    """The two rows above in the given order (every micro-batch must count, not only the last)."""
    t = _tokens()
    return ValueBatch(
        t.input_ids[rows], t.attention_mask[rows], t.response_mask[rows], OLD_VALUES[rows], RETURNS[rows]
    )


@pytest.mark.parametrize("rows", [[0, 1], [1, 0]])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize(("clip", "loss", "clip_fraction"), [(0.2, 4.87 / 3, 1 / 3), (None, 4.375 / 3, 0.0)])
def test_critic_step_pinned(clip, loss, clip_fraction, micro, rows):
    model = _scalar_model([0.0, 0.5, -0.5])
    torch.testing.assert_close(
        model.response_values(_tokens()) * MASK, torch.tensor([[0.5, -0.5], [0.5, 0.0]])
    )
    cfg = CriticConfig(optim=OPTIM, value_clip=clip, micro_batch_size=micro)
    stats = CriticTrainer(model, cfg, total_steps=1).step(_value_batch(rows))
    assert stats.loss == pytest.approx(loss, rel=1e-6)
    assert stats.extra["value_clip_fraction"] == pytest.approx(clip_fraction)
    assert stats.extra["value_mean"] == pytest.approx(1 / 6)
    assert stats.lr == OPTIM.lr
    # gradient by hand: dL/dV = (V - R) / 3 on tokens where the unclipped error is used, 0 where the clipped
    # one wins (its V enters only through clip(), flat there): row 0 [(0.5-1)/3, (-0.5-2)/3], row 1 [(0.5+1)/3]
    # or 0 when clipped. V = w * E[token] + b, w = 1: dE[1] gets rows' t0 terms (token 1), dE[2] row 0 t1;
    # dw = sum dV * E[token]; db = sum dV.
    dv = [-0.5 / 3, -2.5 / 3, 0.0 if clip else 1.5 / 3]
    de1, de2 = dv[0] + dv[2], dv[1]
    dw = dv[0] * 0.5 + dv[1] * -0.5 + dv[2] * 0.5
    db = sum(dv)
    assert stats.grad_norm == pytest.approx(math.sqrt(de1**2 + de2**2 + dw**2 + db**2), rel=1e-5)


def test_critic_step_on_a_single_token():
    # row 1 alone (one trained token, the clipped one): loss 1.62, clip fraction 1, value mean 0.5
    stats = CriticTrainer(_scalar_model([0.0, 0.5, -0.5]), CriticConfig(optim=OPTIM), total_steps=1).step(
        _value_batch([1])
    )
    assert stats.loss == pytest.approx(1.62, rel=1e-6)
    assert stats.extra["value_clip_fraction"] == 1.0 and stats.extra["value_mean"] == pytest.approx(0.5)


def test_critic_values_split_into_micro_batches():
    model = _scalar_model([0.0, 0.5, -0.5])
    cfg = CriticConfig(optim=OPTIM, micro_batch_size=1)
    values = CriticTrainer(model, cfg, total_steps=1).values(_tokens())
    torch.testing.assert_close(values, torch.tensor([[0.5, -0.5], [0.5, 0.5]]))


# ---------------------------------------------------------------- reward model: RewardTrainer.step
#
# E = [0, 0.5, -1], head w = 1, b = 0.1; last_token_scores reads the last response token.
# pair 1: chosen [2, 2] -> -1 + 0.1 = -0.9, rejected [1] -> 0.6;  pair 2: chosen [2, 1] -> 0.6, rejected [1] -> 0.6
# Bradley-Terry with margin = pair margin [0, 0.5] + rm.margin 0.25: diff = c - r - margin = [-1.75, -0.75]
#   loss = mean(softplus(1.75), softplus(0.75)) + center_coef 0.1 * mean((c + r)^2) = ... + 0.1 * (0.09 + 1.44) / 2
# pair accuracy: no win, one tie (half) -> 0.25; margin mean(-1.5, 0) = -0.75; mean reward mean(-0.15, 0.6) = 0.225


def test_pairwise_accuracy_counts_a_tie_as_half():
    from loopline.training.critic import pairwise_accuracy

    # wins 1/4, ties 1/4 -> 0.25 + 0.5 * 0.25
    assert pairwise_accuracy(torch.tensor([1.0, 0.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 3.0, 4.0])) == 0.375


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
@pytest.mark.parametrize("micro", [1, 2])
def test_reward_step_pinned(micro, order):
    model = _scalar_model([0.0, 0.5, -1.0], bias=0.1)
    chosen_rows, margins = [[2, 2], [2, 1]], [0.0, 0.5]
    chosen = collate([[1], [1]], [chosen_rows[i] for i in order], pad_id=0)
    rejected = collate([[1], [1]], [[1], [1]], pad_id=0)
    pairs = PairBatch(chosen, rejected, torch.tensor([margins[i] for i in order]))
    cfg = RewardModelConfig(optim=OPTIM, margin=0.25, center_coef=0.1, micro_batch_size=micro)
    trainer = RewardTrainer(model, cfg, total_steps=1)
    torch.testing.assert_close(trainer.scores(chosen), torch.tensor([[-0.9, 0.6][i] for i in order]))
    stats = trainer.step(pairs)
    # the gradient of the whole-batch loss, whatever the micro-batching (scores are w * E[last] + b)
    e = torch.tensor([0.0, 0.5, -1.0], requires_grad=True)
    w, b = torch.tensor(1.0, requires_grad=True), torch.tensor(0.1, requires_grad=True)
    c, r = w * e[torch.tensor([2, 1])] + b, w * e[torch.tensor([1, 1])] + b
    ref = F.softplus(-(c - r - torch.tensor([0.25, 0.75]))).mean() + 0.1 * (c + r).square().mean()
    ref.backward()
    want_norm = math.sqrt(float(e.grad.square().sum() + w.grad**2 + b.grad**2))
    assert stats.grad_norm == pytest.approx(want_norm, rel=1e-5)
    assert stats.lr == OPTIM.lr
    want = (F.softplus(torch.tensor(1.75)) + F.softplus(torch.tensor(0.75))).item() / 2 + 0.1 * (
        0.09 + 1.44
    ) / 2
    assert stats.loss == pytest.approx(want, rel=1e-5)
    assert stats.pair_accuracy == pytest.approx(0.25)
    assert stats.reward_margin == pytest.approx(-0.75)
    assert stats.reward_mean == pytest.approx(0.225)
    assert list(stats.extra) == ["pair_accuracy", "reward_margin", "reward_mean"]  # the metrics row's order


def test_critic_step_with_a_data_parallel_group_of_one_rank(tmp_path):
    # the data-parallel branch (global token counts and statistics summed over the group) on a 1-rank gloo
    # world gives the single-process numbers
    import torch.distributed as dist

    assert not dist.is_initialized()
    cfg = CriticConfig(optim=OPTIM, value_clip=0.2, micro_batch_size=1)
    alone = [
        CriticTrainer(_scalar_model([0.0, 0.5, -0.5]), cfg, 1).step(_value_batch(r)) for r in ([0, 1], [1])
    ]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        grouped = [
            CriticTrainer(_scalar_model([0.0, 0.5, -0.5]), cfg, 1, group=dist.group.WORLD).step(
                _value_batch(r)
            )
            for r in ([0, 1], [1])
        ]
    finally:
        dist.destroy_process_group()
    assert grouped[0].loss == pytest.approx(4.87 / 3, rel=1e-6)
    assert grouped[1].loss == pytest.approx(1.62, rel=1e-6)  # one token: divided by 1
    for a, g in zip(alone, grouped, strict=True):  # float64 sums over the group: the same numbers exactly
        assert (g.loss, g.extra, g.grad_norm, g.lr) == (a.loss, a.extra, a.grad_norm, a.lr)


def test_response_logprobs_ignore_left_padding_with_absolute_positions():
    # Rotary models (Qwen2, Llama) only see relative positions, so wrong absolute position ids go unnoticed
    # there; GPT-2 adds a learned embedding per absolute position. A left-padded row must score its response
    # exactly as when alone: positions count real tokens only, and padding is masked out of attention.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    short, long = ([1, 4], [5, 6]), ([1, 7, 8, 9, 10], [11, 12, 13])
    with torch.no_grad():
        both, _ = response_logprobs(model, collate([short[0], long[0]], [short[1], long[1]], pad_id=0))
        alone, _ = response_logprobs(model, collate([short[0]], [short[1]], pad_id=0))
    torch.testing.assert_close(both[0, :2], alone[0], atol=1e-5, rtol=0)
    # and both equal a plain forward pass (positions 0, 1, 2, ...) at the positions before each token
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([short[0] + short[1]])).logits[0]
    torch.testing.assert_close(alone[0], torch.log_softmax(logits, -1)[[1, 2], [5, 6]], atol=1e-5, rtol=0)
