"""max_tokens_per_micro_batch: a step on micro-batches grouped by token count has the loss and gradients of the
fixed micro-batch path on the same rows (float64, within 1e-6), for every loss aggregation, SFT, DPO, the reward
model and the critic; the budget bounds each forward's padded tokens. And the critic (and reward model) honour
training.activation_checkpointing.

The groupings differ from the fixed path's, so a normalisation by a micro-batch's own tokens or rows (rather
than its share of the global batch's) would move the gradients here."""

from __future__ import annotations

import pytest
import torch

from loopline.config import (
    CriticConfig,
    DPOConfig,
    GRPOConfig,
    OptimConfig,
    RewardModelConfig,
    TinyModelConfig,
)
from loopline.data.batches import RolloutBatch, TokenBatch, collate, split_rows
from loopline.data.preference import PairBatch
from loopline.data.token_budget import plan_micro_batches, row_lengths
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.rollout.config import SamplingConfig
from loopline.training.critic import CriticTrainer, RewardTrainer, ScalarModel, ValueBatch
from loopline.training.parallel import apply_activation_checkpointing
from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs

pytestmark = pytest.mark.unit

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1e9)
P_LENS, R_LENS = [3, 6, 2, 4, 5, 2, 3, 6], [7, 6, 4, 7, 1, 0, 2, 5]  # row totals 2..12 tokens
BUDGET = 24  # rows x (longest prompt + longest response) per micro-batch; the fixed path: 3 rows (up to 39)
FIXED = 3


def _model() -> torch.nn.Module:
    return build_tiny_model(SMALL, build_byte_tokenizer(), seed=0).to(torch.float64)


def _tokens(seed: int, r_lens: list[int] = R_LENS) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in P_LENS]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in r_lens]
    return collate(prompts, responses, pad_id=0)


def _rollout() -> RolloutBatch:
    tokens = _tokens(3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        current, _ = response_logprobs(_model(), tokens)
    noise = lambda: 0.8 * (torch.rand(current.shape, generator=g, dtype=torch.float64) - 0.5)  # noqa: E731
    return RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask, old_logprobs=current + noise(),
        ref_logprobs=current + noise(), advantages=torch.randn(8, generator=g, dtype=torch.float64),
        rewards=torch.zeros(8),
    )  # fmt: skip


def _pairs() -> PairBatch:
    chosen, rejected = _tokens(5), _tokens(5, r_lens=[2, 7, 3, 1, 6, 4, 5, 2])
    g = torch.Generator().manual_seed(6)
    ref = lambda: torch.randn(8, generator=g, dtype=torch.float64)  # noqa: E731
    return PairBatch(chosen, rejected, torch.rand(8, generator=g, dtype=torch.float64), ref(), ref())


def _grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(
        lambda *_: seen.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    )
    return seen


def _assert_same(a: tuple[float, dict], b: tuple[float, dict]) -> None:
    assert b[0] == pytest.approx(a[0], rel=0, abs=1e-6)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(b[1][name], a[1][name], rtol=0, atol=1e-6, msg=name)
    assert max(float(g.abs().max()) for g in a[1].values()) > 1e-3  # gradients that say something


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "fixed_length"])
def test_grpo_step_on_a_token_budget_equals_the_fixed_micro_batches(
    agg: str,
) -> None:
    cfg = GRPOConfig(loss_agg=agg, kl_coef=0.05, entropy_coef=0.01, sampling=SamplingConfig(max_new_tokens=7))
    out = []
    for budget in (0, BUDGET):
        model = _model()
        trainer = PolicyTrainer(
            model, OPTIM, 10, loss=grpo_loss(cfg), micro_batch_size=FIXED, max_tokens=budget
        )
        grads = _grads(model, trainer.optimizer)
        out.append((trainer.policy_step(_rollout(), cfg.kl_coef).loss, grads))
    _assert_same(*out)
    bins = plan_micro_batches(*row_lengths(_rollout()), BUDGET)
    assert len(bins) > len(split_rows(_rollout(), FIXED))  # other groups than the fixed path's


def test_sft_step_on_a_token_budget_equals_the_fixed_micro_batches() -> None:
    out = []
    for budget in (0, BUDGET):
        model = _model()
        trainer = PolicyTrainer(model, OPTIM, 10)
        grads = _grads(model, trainer.optimizer)
        out.append((trainer.sft_step(_tokens(3), FIXED, max_tokens=budget).loss, grads))
    _assert_same(*out)


def test_dpo_step_on_a_token_budget_equals_the_fixed_micro_batches() -> None:
    out = []
    for budget in (0, BUDGET):
        model = _model()
        trainer = PolicyTrainer(model, OPTIM, 10)
        grads = _grads(model, trainer.optimizer)
        cfg = DPOConfig(micro_batch_size=FIXED, max_tokens_per_micro_batch=budget)
        out.append((trainer.dpo_step(_pairs(), cfg).loss, grads))
    _assert_same(*out)


def _scalar(checkpointing: str = "none", policy: torch.nn.Module | None = None) -> ScalarModel:
    # a float64 body; the head reads it in float32 (ScalarModel's own cast)
    model = ScalarModel.from_policy(policy or _model(), checkpointing=checkpointing)
    torch.nn.init.normal_(model.head.weight, generator=torch.Generator().manual_seed(0), std=0.5)
    return model


def test_reward_model_step_on_a_token_budget_equals_the_fixed_micro_batches() -> None:
    out = []
    for budget in (0, BUDGET):
        model = _scalar()
        cfg = RewardModelConfig(micro_batch_size=FIXED, max_tokens_per_micro_batch=budget, optim=OPTIM)
        trainer = RewardTrainer(model, cfg, 10)
        grads = _grads(model, trainer.optimizer)
        out.append((trainer.step(_pairs()).loss, grads))
    _assert_same(*out)


def _values() -> ValueBatch:
    tokens = _tokens(7)
    g = torch.Generator().manual_seed(8)
    old = torch.randn(tokens.response_mask.shape, generator=g, dtype=torch.float64)
    returns = torch.randn(tokens.response_mask.shape, generator=g, dtype=torch.float64)
    return ValueBatch(tokens.input_ids, tokens.attention_mask, tokens.response_mask, old, returns)


def _critic_step(model: ScalarModel, budget: int = 0) -> tuple[float, dict]:
    cfg = CriticConfig(micro_batch_size=FIXED, max_tokens_per_micro_batch=budget, optim=OPTIM, value_clip=0.5)
    trainer = CriticTrainer(model, cfg, 10)
    grads = _grads(model, trainer.optimizer)
    return trainer.step(_values()).loss, grads


def test_critic_step_on_a_token_budget_equals_the_fixed_micro_batches() -> None:
    _assert_same(_critic_step(_scalar()), _critic_step(_scalar(), BUDGET))


def test_a_row_over_the_budget_is_refused_naming_the_field() -> None:
    model = _model()
    trainer = PolicyTrainer(model, OPTIM, 10)
    with pytest.raises(
        ValueError, match=r"sft.max_tokens_per_micro_batch=11 is smaller than a row of 12 tokens"
    ):
        trainer.sft_step(_tokens(3), FIXED, max_tokens=11)


def _saved_bytes(model: ScalarModel) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train().response_values(_values())
    return total


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_critic_honours_activation_checkpointing(mode: str) -> None:
    plain, checkpointed = _critic_step(_scalar()), _critic_step(_scalar(mode))
    _assert_same(plain, checkpointed)
    assert _saved_bytes(_scalar(mode)) < _saved_bytes(_scalar())  # backward keeps less: the layers recompute
    # a critic copied from a checkpointed policy follows its own setting, not the policy's
    policy = apply_activation_checkpointing(_model(), "full")
    assert _saved_bytes(_scalar("none", policy)) == _saved_bytes(_scalar())
