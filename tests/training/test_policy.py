"""PolicyTrainer: exact micro-batch accumulation, update direction, LR schedule, non-finite skip."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from loopline.config import GRPOConfig, OptimConfig, SamplingConfig
from loopline.data.batches import RolloutBatch, collate
from loopline.training.optim import build_optimizer, step_chunks, step_in_chunks
from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs

MAX_NEW = 6


def _rollout(model, kl: bool) -> RolloutBatch:
    """Six rows with prompts of 2-5 tokens and responses of 0-6 tokens (one empty, fully masked)."""
    g = torch.Generator().manual_seed(1)
    p_lens, r_lens = [3, 5, 2, 4, 3, 5], [6, 1, 0, 4, 2, 5]
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in p_lens]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in r_lens]
    tokens = collate(prompts, responses, pad_id=0)
    with torch.no_grad():
        current, _ = response_logprobs(model, tokens)
    # behaviour/ref log-probs off by up to +-0.4 nats: ratios reach 0.67..1.5, so some tokens clip
    old = current + 0.8 * (torch.rand(current.shape, generator=g) - 0.5)
    ref = current + 0.8 * (torch.rand(current.shape, generator=g) - 0.5) if kl else None
    return RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=old, ref_logprobs=ref,
        advantages=torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 2.0]), rewards=torch.zeros(6),
    )  # fmt: skip


def _grads_of_one_step(model, batch, cfg: GRPOConfig):
    """Run one policy_step on a copy of `model`; return (stats, gradients as the optimizer saw them)."""
    model = copy.deepcopy(model)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1e9)  # no clipping: compare raw gradients
    trainer = PolicyTrainer(model, optim, 10, loss=grpo_loss(cfg), micro_batch_size=cfg.micro_batch_size)
    seen = {}

    def snapshot(opt, args, kwargs):
        seen.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(snapshot)
    stats = trainer.policy_step(batch, cfg.kl_coef)
    return stats, seen


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "fixed_length"])
@pytest.mark.parametrize("micro", [4, 1])
def test_micro_batches_accumulate_to_the_full_batch_gradient(small_model, loss_agg, micro):
    # 6 rows split 4+2 or 1x6 with different token counts per micro-batch: only exact weighting of
    # each micro-batch's loss (by tokens for token_mean, by rows otherwise) matches the full batch.
    batch = _rollout(small_model, kl=True)
    base = dict(
        loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01, sampling=SamplingConfig(max_new_tokens=MAX_NEW)
    )
    full_stats, full = _grads_of_one_step(small_model, batch, GRPOConfig(micro_batch_size=6, **base))
    part_stats, part = _grads_of_one_step(small_model, batch, GRPOConfig(micro_batch_size=micro, **base))
    assert full.keys() == part.keys() and len(full) > 0
    for name in full:
        torch.testing.assert_close(part[name], full[name], rtol=1e-4, atol=1e-7, msg=name)
    assert part_stats.loss == pytest.approx(full_stats.loss, rel=1e-5, abs=1e-7)
    assert part_stats.grad_norm == pytest.approx(full_stats.grad_norm, rel=1e-4)
    for key in ("policy_loss", "kl", "entropy", "clip_fraction"):
        assert part_stats.extra[key] == pytest.approx(full_stats.extra[key], rel=1e-5, abs=1e-7), key
    assert full_stats.extra["clip_fraction"] > 0  # the batch does exercise the clipped branch


def test_policy_step_moves_probability_towards_positive_advantage(small_model, tokenizer):
    # Same prompt, two responses: rewarded "12" (A = +1) and unrewarded "99" (A = -1).
    prompt = tokenizer("5+7=")["input_ids"]
    good, bad = (
        tokenizer("12", add_special_tokens=False)["input_ids"],
        tokenizer("99", add_special_tokens=False)["input_ids"],
    )
    tokens = collate([prompt, prompt], [good, bad], pad_id=0)
    batch = RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=None, ref_logprobs=None, advantages=torch.tensor([1.0, -1.0]), rewards=torch.tensor([1.0, 0.0]),
    )  # fmt: skip
    loss = grpo_loss(GRPOConfig(sampling=SamplingConfig(max_new_tokens=2)))
    trainer = PolicyTrainer(
        small_model, OptimConfig(lr=1e-2, warmup_steps=0), 5, loss=loss, micro_batch_size=64
    )
    with torch.no_grad():
        before = response_logprobs(small_model, tokens)[0].sum(dim=1)
    for _ in range(3):
        trainer.policy_step(batch, kl_coef=0.0)
    with torch.no_grad():
        after = response_logprobs(small_model, tokens)[0].sum(dim=1)
    assert after[0] > before[0] + 0.1
    assert after[1] < before[1] - 0.1


def test_sft_micro_batches_match_full_batch(small_model):
    batch = _rollout(small_model, kl=False)
    results = []
    for micro in (6, 4):
        model = copy.deepcopy(small_model)
        trainer = PolicyTrainer(model, OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1e9), total_steps=10)
        grads = {}
        trainer.optimizer.register_step_pre_hook(
            lambda *_, m=model, g=grads: g.update({n: p.grad.clone() for n, p in m.named_parameters()})
        )
        results.append((trainer.sft_step(batch, micro), grads))
    (s_full, g_full), (s_part, g_part) = results
    assert s_part.loss == pytest.approx(s_full.loss, rel=1e-5)
    for name in g_full:
        torch.testing.assert_close(g_part[name], g_full[name], rtol=1e-4, atol=1e-7, msg=name)
    # the loss is the token-mean NLL: near log(259) = 5.56 for a near-uniform random model
    assert s_full.loss == pytest.approx(math.log(259), abs=0.3)


def test_response_logprobs_ignore_left_padding(small_model):
    # A short row padded to the width of a longer one must score its response exactly as alone.
    short, long = ([1, 40, 41], [50, 51]), ([1, 60, 61, 62, 63, 64], [70, 71, 72])
    both = collate([short[0], long[0]], [short[1], long[1]], pad_id=0)
    alone = collate([short[0]], [short[1]], pad_id=0)
    with torch.no_grad():
        lp_both, ent = response_logprobs(small_model, both, with_entropy=True)
        lp_alone, _ = response_logprobs(small_model, alone)
    torch.testing.assert_close(lp_both[0, :2], lp_alone[0, :2], atol=1e-5, rtol=0)
    assert ent is not None and ent.shape == (2, 3)
    # and they are the log-softmax of a plain forward pass at the positions before each token
    with torch.no_grad():
        logits = small_model(input_ids=torch.tensor([short[0] + short[1]])).logits[0]
    manual = torch.log_softmax(logits, -1)[[2, 3], [50, 51]]
    torch.testing.assert_close(lp_alone[0], manual, atol=1e-5, rtol=0)


def test_non_finite_gradient_skips_the_update(small_model):
    batch = _rollout(small_model, kl=False)
    batch.advantages = torch.tensor([float("nan")] + [1.0] * 5)
    loss = grpo_loss(GRPOConfig(sampling=SamplingConfig(max_new_tokens=MAX_NEW)))
    trainer = PolicyTrainer(
        small_model, OptimConfig(lr=1e-2, warmup_steps=0), 10, loss=loss, micro_batch_size=64
    )
    before = {n: p.detach().clone() for n, p in small_model.named_parameters()}
    stats = trainer.policy_step(batch, kl_coef=0.0)
    assert not math.isfinite(stats.grad_norm)
    for n, p in small_model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert trainer.scheduler.last_epoch == 0  # the schedule did not advance either
    assert all(s == {} for s in trainer.optimizer.state.values()) or not trainer.optimizer.state


@pytest.mark.parametrize(
    "schedule,expected",
    [
        # lr 1, warmup 2, total 6, min ratio 0.1; after warmup progress p = (step - 2) / 4
        # warmup: (step + 1) / 2 -> 0.5, 1.0
        # cosine: 0.1 + 0.9 * 0.5 * (1 + cos(pi p)) at p = 0, 1/4, 1/2, 3/4, 1
        ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 0.55,
                    0.1 + 0.45 * (1 - math.cos(math.pi / 4)), 0.1, 0.1]),
        # linear: 0.1 + 0.9 * (1 - p)
        ("linear", [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]),
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ],
)  # fmt: skip
def test_lr_schedule(schedule, expected):
    model = torch.nn.Linear(2, 2)
    opt, sched = build_optimizer(model, OptimConfig(lr=1.0, warmup_steps=2, schedule=schedule), total_steps=6)
    got = []
    for _ in expected:
        got.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert got == pytest.approx(expected)


def test_a_step_in_chunks_is_bitwise_one_step_and_adamw_s_formula():
    """step_in_chunks (training/policy.py) steps each group's weights a chunk at a time, so foreach AdamW's
    temporaries are one chunk's: every weight stepped once, bitwise as one whole step (two groups, a chunk a
    tensor), and the update AdamW's formula gives against a float64 hand computation over two steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(300, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 300)
    )
    whole = copy.deepcopy(model)
    groups = lambda m: [{"params": list(m.parameters())[:2]}, {"params": list(m.parameters())[2:]}]  # noqa: E731
    chunked, plain = (
        torch.optim.AdamW(groups(model), weight_decay=0.1),
        torch.optim.AdamW(groups(whole), weight_decay=0.1),
    )
    assert [len(c) for c in step_chunks(list(model.parameters()), 16 * 16 * 4 + 16 * 4)] == [1, 2, 1, 1]
    seen: list[int] = []  # the weights each call of the step takes
    chunked.register_step_pre_hook(
        lambda opt, *_: seen.append(sum(len(g["params"]) for g in opt.param_groups))
    )
    for _ in range(3):
        for a, b in zip(model.parameters(), whole.parameters()):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        step_in_chunks(chunked, max_bytes=1)
        plain.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters()))
    assert seen == [1] * 15 and [len(g["params"]) for g in chunked.param_groups] == [2, 3]
    assert all(int(chunked.state[p]["step"]) == 3 for p in model.parameters())
    step_in_chunks(chunked)  # both groups in one chunk: one call, as a plain step
    assert seen[15:] == [5]

    model = torch.nn.Linear(4, 3)
    cfg = OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.1, betas=(0.9, 0.95))
    opt, _ = build_optimizer(model, cfg, total_steps=10)
    w = model.weight.detach().double().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t in (1, 2):
        g = torch.randn(3, 4, dtype=torch.float64)
        model.weight.grad, model.bias.grad = g.float(), torch.zeros(3)
        step_in_chunks(opt)
        b1, b2 = cfg.betas
        w = w * (1 - cfg.lr * cfg.weight_decay)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - cfg.lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + 1e-8)
    torch.testing.assert_close(model.weight.detach().double(), w, atol=1e-6, rtol=0)


def test_grpo_loss_is_built_from_the_config():
    cfg = GRPOConfig(
        policy_loss="clip", clip_low=0.1, clip_high=0.3, dual_clip=2.0, loss_agg="fixed_length",
        entropy_coef=0.01, kl_estimator="k2", sampling=SamplingConfig(max_new_tokens=7),
    )  # fmt: skip
    loss = grpo_loss(cfg)
    assert (loss.surrogate, loss.clip_low, loss.clip_high, loss.dual_clip) == ("clip", 0.1, 0.3, 2.0)
    assert (loss.agg, loss.max_len, loss.entropy_coef, loss.kl_estimator) == ("fixed_length", 7, 0.01, "k2")
    assert grpo_loss(cfg, max_len=11).max_len == 11  # the agent's driver allows another response width


@pytest.mark.parametrize("micro", [6, 4])
def test_behaviour_weights_reach_the_gradient_token_by_token(small_model, micro):
    # weights 0 on rows 1 and 3 give the gradient of a batch whose rows 1 and 3 have advantage 0 (the loss
    # still divides by every drawn token); weight 2 on row 0 gives the gradient of row 0's advantage doubled
    # when nothing clips (ratios of 1: old = current)
    batch = _rollout(small_model, kl=False)
    with torch.no_grad():
        current, _ = response_logprobs(small_model, batch)
    batch = RolloutBatch(**{**batch.__dict__, "old_logprobs": current})
    cfg = GRPOConfig(micro_batch_size=micro, sampling=SamplingConfig(max_new_tokens=MAX_NEW))
    weights = torch.ones_like(current)
    weights[[1, 3]] = 0.0
    weights[0] = 2.0
    advantages = batch.advantages.clone()
    advantages[[1, 3]] = 0.0
    advantages[0] *= 2.0
    _, weighted = _grads_of_one_step(
        small_model, RolloutBatch(**{**batch.__dict__, "is_weights": weights}), cfg
    )
    _, moved = _grads_of_one_step(
        small_model, RolloutBatch(**{**batch.__dict__, "advantages": advantages}), cfg
    )
    _, plain = _grads_of_one_step(small_model, batch, cfg)
    assert weighted.keys() == moved.keys() and weighted
    for name in weighted:
        torch.testing.assert_close(weighted[name], moved[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.allclose(weighted[n], plain[n]) for n in weighted)


def test_an_sft_step_at_lr_scale_moves_the_weights_as_the_scaled_learning_rate_for_that_step_only(
    small_model,
):
    # AdamW's update is proportional to the learning rate (same gradients, same moments): one step at
    # lr 1e-3 x 0.5 equals one at lr 5e-4; the scale is for that step only, the schedule's lr comes back
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (3, 5, 2, 4)]
    targets = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (4, 2, 6, 3)]
    batch = collate(prompts, targets, pad_id=0)

    def trainer(lr: float) -> PolicyTrainer:
        return PolicyTrainer(
            copy.deepcopy(small_model), OptimConfig(lr=lr, warmup_steps=0, grad_clip=1e9), 10
        )

    scaled, half = trainer(1e-3), trainer(5e-4)
    assert scaled.sft_step(batch, 4, lr_scale=0.5).lr == pytest.approx(5e-4)
    assert half.sft_step(batch, 4).lr == pytest.approx(5e-4)
    for (name, a), b in zip(scaled.model.named_parameters(), half.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0, msg=name)
    assert any(not torch.equal(a, b) for a, b in zip(scaled.model.parameters(), small_model.parameters()))
    assert scaled.sft_step(batch, 4).lr == pytest.approx(1e-3)  # constant schedule, unscaled again
