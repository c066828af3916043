"""Scalar heads (critic, reward model), their trainers, and PolicyTrainer.dpo_step."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from loopline.config import CriticConfig, DPOConfig, OptimConfig, RewardModelConfig
from loopline.data.batches import collate
from loopline.data.preference import PairBatch
from loopline.training.critic import CriticTrainer, RewardTrainer, ScalarModel, ValueBatch, pairwise_accuracy
from loopline.training.policy import PolicyTrainer, sequence_logprobs

NO_CLIP = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1e9)


def _capture_grads(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A dict filled with the gradients as the optimizer sees them at its next step."""
    seen: dict[str, torch.Tensor] = {}

    def hook(*_: object) -> None:
        seen.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    optimizer.register_step_pre_hook(hook)
    return seen


def _tokens(seed: int, p_lens: list[int], r_lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in p_lens]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in r_lens]
    return prompts, responses


def _scalar(small_model) -> ScalarModel:
    model = ScalarModel.from_policy(small_model)
    torch.nn.init.normal_(model.head.weight, std=0.5)  # a non-zero head, so positions differ
    return model


def test_values_and_last_token_scores_ignore_padding(small_model):
    model = _scalar(small_model).eval()
    prompts, responses = _tokens(0, [3, 5, 2], [4, 1, 3])
    batch = collate(prompts, responses, pad_id=0)
    with torch.no_grad():
        values, scores = model.response_values(batch), model.last_token_scores(batch)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            alone = collate([p], [r], pad_id=0)  # no padding at all
            full = model(alone.input_ids, alone.attention_mask)[0]  # (L,)
            # the value of the state before response token t is read at position P - 1 + t
            torch.testing.assert_close(values[i, : len(r)], full[len(p) - 1 : -1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(scores[i], full[-1], atol=1e-5, rtol=1e-5)


def test_a_fresh_head_scores_zero_and_the_body_is_a_copy(small_model):
    model = ScalarModel.from_policy(small_model)
    batch = collate(*_tokens(1, [2, 3], [2, 2]), pad_id=0)
    assert torch.equal(model.last_token_scores(batch), torch.zeros(2))
    assert model.body is not small_model.base_model
    assert pairwise_accuracy(torch.zeros(4), torch.zeros(4)) == 0.5  # ties count half


def _value_batch(model: ScalarModel) -> ValueBatch:
    prompts, responses = _tokens(2, [3, 5, 2, 4, 3], [6, 1, 3, 4, 2])
    tokens = collate(prompts, responses, pad_id=0)
    with torch.no_grad():
        old = model.response_values(tokens)
    returns = torch.linspace(-1.0, 1.0, old.numel()).view_as(old) * tokens.response_mask
    return ValueBatch(tokens.input_ids, tokens.attention_mask, tokens.response_mask, old, returns)


@pytest.mark.parametrize("micro", [1, 2, 3])  # 5 rows: one per micro-batch, 2+2+1, 3+2
def test_critic_micro_batches_accumulate_to_the_full_batch_gradient(small_model, micro):
    base = _scalar(small_model)
    batch = _value_batch(base)
    rows = batch.input_ids.shape[0]
    assert micro < rows  # the whole batch in one micro-batch against several: never a run against itself
    grads = []
    for size in (rows, micro):
        model = copy.deepcopy(base)
        trainer = CriticTrainer(model, CriticConfig(optim=NO_CLIP, micro_batch_size=size), total_steps=1)
        seen = _capture_grads(model, trainer.optimizer)
        trainer.step(batch)
        grads.append(seen)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4)


def test_critic_steps_fit_the_returns(small_model):
    model = _scalar(small_model)
    batch = _value_batch(model)
    trainer = CriticTrainer(model, CriticConfig(optim=NO_CLIP, value_clip=None), total_steps=30)
    losses = [trainer.step(batch).loss for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def _pairs(seed: int = 3) -> PairBatch:
    prompts, chosen = _tokens(seed, [3, 4, 2, 5, 3, 4], [2, 3, 1, 4, 2, 2])
    _, rejected = _tokens(seed + 1, [3, 4, 2, 5, 3, 4], [3, 1, 2, 2, 4, 3])
    return PairBatch(collate(prompts, chosen, 0), collate(prompts, rejected, 0), torch.zeros(6))


def test_reward_model_learns_the_pairs_and_round_trips(small_model, tmp_path):
    model = ScalarModel.from_policy(small_model)
    pairs = _pairs()
    cfg = RewardModelConfig(optim=OptimConfig(lr=3e-3, warmup_steps=0), micro_batch_size=4, center_coef=0.01)
    trainer = RewardTrainer(model, cfg, total_steps=40)
    first = trainer.step(pairs)
    assert first.loss == pytest.approx(math.log(2), abs=1e-6)  # zero head: sigmoid(0) for every pair
    for _ in range(39):
        last = trainer.step(pairs)
    assert last.pair_accuracy == 1.0 and last.loss < 0.3
    model.save(tmp_path / "rm")
    loaded = ScalarModel.load(tmp_path / "rm")
    torch.testing.assert_close(
        trainer.scores(pairs.chosen), RewardTrainer(loaded, cfg, 1).scores(pairs.chosen)
    )


def _dpo_pairs(model) -> PairBatch:
    pairs = _pairs(5)
    with torch.no_grad():  # the reference is the model as it is
        pairs.ref_chosen = sequence_logprobs(model, pairs.chosen)
        pairs.ref_rejected = sequence_logprobs(model, pairs.rejected)
    return pairs


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge", "robust"])
def test_dpo_micro_batches_accumulate_and_the_first_loss_is_known(small_model, loss):
    pairs = _dpo_pairs(small_model)
    grads, stats = [], []
    for micro in (6, 4):
        model = copy.deepcopy(small_model)
        trainer = PolicyTrainer(model, NO_CLIP, total_steps=1)
        seen = _capture_grads(model, trainer.optimizer)
        smoothing = 0.1 if loss == "robust" else 0.0
        cfg = DPOConfig(loss=loss, beta=0.5, micro_batch_size=micro, label_smoothing=smoothing, nll_coef=0.3)
        stats.append(trainer.dpo_step(pairs, cfg))
        grads.append(seen)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4)
    # policy = reference: delta = 0, so sigmoid/robust give log 2, hinge 1, ipo (1 / (2 beta))^2 = 1
    expected = {"sigmoid": math.log(2), "robust": math.log(2), "hinge": 1.0, "ipo": 1.0}[loss]
    assert stats[0].pref_loss == pytest.approx(expected, rel=1e-5)
    # RPO term: the mean over pairs of the chosen completion's per-token NLL (the model is the reference)
    nll = float((-pairs.ref_chosen / pairs.chosen.response_mask.sum(1)).mean())
    assert stats[0].chosen_nll == pytest.approx(nll, rel=1e-5)
    assert stats[0].loss == pytest.approx(expected + 0.3 * nll, rel=1e-5)
    assert stats[0].reward_margin == 0.0


def test_dpo_steps_raise_the_margin(small_model):
    pairs = _dpo_pairs(small_model)
    trainer = PolicyTrainer(small_model, OptimConfig(lr=3e-3, warmup_steps=0), total_steps=20)
    cfg = DPOConfig(beta=0.5, micro_batch_size=6)
    for _ in range(20):
        stats = trainer.dpo_step(pairs, cfg)
    assert stats.pref_accuracy == 1.0 and stats.reward_margin > 0


def test_reward_model_scorer_ends_completions_with_eos(small_model, tokenizer):
    from loopline.training.critic import RewardModelScorer

    model = _scalar(small_model)
    eos = tokenizer.eos_token_id
    scorer = RewardModelScorer(model, pad_id=tokenizer.pad_token_id, eos_id=eos, batch_size=2)
    prompts, completions = _tokens(7, [3, 4, 2], [2, 3, 1])
    stopped = scorer.score(prompts, completions)  # ended by a stop string: EOS appended
    with_eos = scorer.score(prompts, [c + [eos] for c in completions])  # already ended: unchanged
    torch.testing.assert_close(stopped, with_eos)
    batch = collate(prompts, [c + [eos] for c in completions], tokenizer.pad_token_id)
    with torch.no_grad():
        torch.testing.assert_close(stopped, model.last_token_scores(batch))
