"""Shared prompt forwards: a batch whose rows repeat prompts (GRPO groups) forwards each distinct prompt once, and
its log-probs, entropies and the trainer's gradients equal the padded forward's, row by row."""

from __future__ import annotations

import copy

import torch
from torch import nn

from loopline.config import GRPOConfig, OptimConfig, SamplingConfig
from loopline.data.batches import RolloutBatch, TokenBatch, collate
from loopline.training.policy import PolicyTrainer, behaviour_logprobs, grpo_loss, response_logprobs
from loopline.training.prefix import shared_prompt_logits, shared_prompts
from tests.numerics import assert_adam_updates_close, record_grads

OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1e9)


def _grouped_batch(seed: int = 0, groups: int = 4, group_size: int = 4) -> TokenBatch:
    """Prompts of 2-6 tokens (so left padding differs), each repeated for its group; responses of 0-9 tokens and
    one of 25, as sampled: the same prompt can end in different lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = torch.randint(3, 259, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group_size):
            prompts.append(prompt)
            responses.append(
                torch.randint(3, 259, (int(torch.randint(0, 10, (1,), generator=g)),), generator=g).tolist()
            )
    responses[1] = torch.randint(3, 259, (25,), generator=g).tolist()
    return collate(prompts, responses, pad_id=0)


def _padded_logprobs(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """The plain padded forward over every row (what each row alone computes)."""
    p = batch.prompt_len
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions
    ).logits
    logits = logits[:, p - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, p:, None]).squeeze(-1)


def test_shared_prompts_finds_each_distinct_prompt_once():
    batch = collate([[5, 6], [7], [5, 6], [7], [5, 6]], [[1], [2], [3, 4], [], [9]], pad_id=0)
    shared = shared_prompts(batch)
    assert shared is not None
    assert len(shared.rows) == 2
    # every row maps to a distinct prompt whose representative row carries the same prompt tokens
    p = batch.prompt_len
    assert torch.equal(batch.input_ids[shared.rows[shared.inverse], :p], batch.input_ids[:, :p])
    assert (
        shared.inverse[0] == shared.inverse[2] == shared.inverse[4] != shared.inverse[1] == shared.inverse[3]
    )
    assert shared_prompts(collate([[5, 6], [7]], [[1], [2]], pad_id=0)) is None  # nothing to share


def test_shared_prompt_logprobs_and_entropies_equal_the_padded_forward(small_model):
    batch = _grouped_batch()
    mask = batch.response_mask.bool()
    calls: list[tuple[int, int]] = []
    hook = small_model.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    with torch.no_grad():
        shared, entropy = response_logprobs(small_model, batch, with_entropy=True)
    hook.remove()
    p, c = batch.prompt_len, batch.response_mask.shape[1]
    assert calls == [(4, p), (16, c)]  # 4 prompts forwarded once each, then the 16 responses on their cache
    with torch.no_grad():
        padded = _padded_logprobs(small_model, batch)
        torch.testing.assert_close(shared[mask], padded[mask], atol=1e-5, rtol=0)
        per_row = torch.cat(
            [response_logprobs(small_model, _row(batch, i), with_entropy=True)[1] for i in range(16)]
        )
        assert entropy is not None
        torch.testing.assert_close(entropy[mask], per_row[mask], atol=1e-5, rtol=0)
        trained, sampled = behaviour_logprobs(small_model, batch, 0.7)
        torch.testing.assert_close(trained[mask], padded[mask], atol=1e-5, rtol=0)
        assert not torch.allclose(sampled[mask], trained[mask])


def _row(batch: TokenBatch, i: int) -> TokenBatch:
    """Row i alone: its own forward, nothing shared."""
    return TokenBatch(
        batch.input_ids[i : i + 1], batch.attention_mask[i : i + 1], batch.response_mask[i : i + 1]
    )


def test_a_policy_step_over_groups_makes_the_per_row_update(small_model):
    """micro_batch_size=1 forwards each row alone (nothing shared); 8 forwards two groups at a time."""
    tokens = _grouped_batch(1)
    with torch.no_grad():
        current = _padded_logprobs(small_model, tokens)
    g = torch.Generator().manual_seed(2)
    batch = RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=current + 0.6 * (torch.rand(current.shape, generator=g) - 0.5),
        ref_logprobs=current + 0.6 * (torch.rand(current.shape, generator=g) - 0.5),
        advantages=torch.randn(len(tokens), generator=g), rewards=torch.zeros(len(tokens)),
    )  # fmt: skip
    cfg = GRPOConfig(kl_coef=0.1, entropy_coef=0.01, sampling=SamplingConfig())
    weights = []
    for micro in (1, 8):
        trainer = PolicyTrainer(
            copy.deepcopy(small_model), OPTIM, 10, loss=grpo_loss(cfg), micro_batch_size=micro
        )
        seen = record_grads(trainer.optimizer, trainer.model)
        stats = trainer.policy_step(batch, cfg.kl_coef)
        weights.append(
            (stats, seen.grads, {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        )
    (alone, alone_g, alone_w), (grouped, grouped_g, grouped_w) = weights
    assert (
        abs(alone.loss - grouped.loss) < 1e-5
        and abs(alone.grad_norm - grouped.grad_norm) < 1e-4 * alone.grad_norm
    )
    # two orders of summing: tests/numerics.py's rule for the weights after AdamW
    before = {n: p.detach() for n, p in small_model.named_parameters()}
    assert_adam_updates_close(
        before, alone_w, grouped_w, lrs=[OPTIM.lr], grads_a=alone_g, grads_b=grouped_g, betas=OPTIM.betas
    )
    assert any(not torch.equal(w, before[name]) for name, w in alone_w.items())


class _NoCache(nn.Module):
    """A model that returns logits only (no KV cache), like one that cannot cache."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, past_key_values=None, **kwargs):
        kwargs["use_cache"] = False
        out = self.model(**kwargs)
        return type("Out", (), {"logits": out.logits})()


def test_a_model_without_a_cache_falls_back_to_the_padded_forward(small_model):
    batch = _grouped_batch(2)
    model = _NoCache(small_model)
    shared = shared_prompts(batch)
    assert shared is not None
    with torch.no_grad():
        assert shared_prompt_logits(model, batch, shared) is None
        mask = batch.response_mask.bool()
        torch.testing.assert_close(
            response_logprobs(model, batch)[0][mask],
            _padded_logprobs(small_model, batch)[mask],
            atol=1e-5,
            rtol=0,
        )


def test_share_prompts_false_forwards_every_row_whole(small_model):
    """model.share_prompts=false: one padded forward of the whole rows, the same log-probs."""
    batch = _grouped_batch(3)
    calls: list[tuple[int, int]] = []
    hook = small_model.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    with torch.no_grad():
        whole, _ = response_logprobs(small_model, batch, share_prompts=False)
        shared, _ = response_logprobs(small_model, batch)
    hook.remove()
    assert calls[0] == tuple(batch.input_ids.shape) and len(calls) == 3  # then the two shared forwards
    mask = batch.response_mask.bool()
    torch.testing.assert_close(shared[mask], whole[mask], atol=1e-5, rtol=0)
