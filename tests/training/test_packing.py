"""model.packing: the packed layout by hand, and every packed forward (policy log-probs and entropies, the
trainers' gradients, scalar heads) against the padded forward of the same batch."""

from __future__ import annotations

import copy

import pytest
import torch

from loopline.config import (
    CriticConfig,
    DPOConfig,
    GRPOConfig,
    OptimConfig,
    RewardModelConfig,
    SamplingConfig,
)
from loopline.data.batches import RolloutBatch, collate
from loopline.data.preference import PairBatch
from loopline.training.critic import CriticTrainer, RewardTrainer, ScalarModel, ValueBatch
from loopline.training.packing import pack, packed_forward
from loopline.training.policy import (
    PolicyTrainer,
    behaviour_logprobs,
    grpo_loss,
    response_logprobs,
    sequence_logprobs,
)
from tests.numerics import assert_adam_updates_close, record_grads

OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1e9)


def test_pack_lays_sequences_end_to_end_first_fit_decreasing():
    # real lengths 3, 1, 2 (row 1 left-padded, row 2 right-padded): width 3, so [seq 0] and [seq 2, seq 1]
    ids = torch.tensor([[11, 12, 13], [0, 0, 21], [31, 32, 0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 1], [1, 1, 0]])
    packing = pack(ids, mask, pad_id=0)
    assert packing.input_ids.tolist() == [[11, 12, 13], [31, 32, 21]]
    assert packing.position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert packing.slot.tolist() == [[0, 1, 2], [-1, -1, 5], [3, 4, -1]]
    assert packing.unpack(packing.input_ids, fill=-7).tolist() == [[11, 12, 13], [-7, -7, 21], [31, 32, -7]]


def test_a_rows_padding_restarts_its_positions():
    # lengths 2 and 1 fit one row of width 2 each: the shorter's row ends in padding counted from 0
    packing = pack(torch.tensor([[5, 6], [7, 0]]), torch.tensor([[1, 1], [1, 0]]))
    assert packing.input_ids.tolist() == [[5, 6], [7, 0]]
    assert packing.position_ids.tolist() == [[0, 1], [0, 0]]


def _long_tail_batch(seed: int = 0, rows: int = 12):
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(2, 7, (rows,), generator=g).tolist()
    r_lens = [0, 1, 30] + torch.randint(1, 9, (rows - 3,), generator=g).tolist()  # one empty, one long
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in p_lens]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in r_lens]
    return collate(prompts, responses, pad_id=0)


def test_packed_logprobs_and_entropies_equal_the_padded_forward(small_model):
    batch = _long_tail_batch()
    assert pack(batch.input_ids, batch.attention_mask).input_ids.numel() < batch.input_ids.numel() / 2
    mask = batch.response_mask.bool()
    with torch.no_grad():
        padded, padded_entropy = response_logprobs(small_model, batch, with_entropy=True)
        packed, packed_entropy = response_logprobs(small_model, batch, with_entropy=True, packed=True)
        assert packed_entropy is not None and padded_entropy is not None
        torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(packed_entropy[mask], padded_entropy[mask], atol=1e-5, rtol=0)
        assert (packed[~mask] == 0).all()
        torch.testing.assert_close(
            sequence_logprobs(small_model, batch, packed=True),
            sequence_logprobs(small_model, batch),
            atol=1e-4,
            rtol=0,
        )
        for a, b in zip(
            behaviour_logprobs(small_model, batch, 0.7, packed=True),
            behaviour_logprobs(small_model, batch, 0.7),
        ):
            torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=0)


def _grads(trainer: PolicyTrainer, step) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}

    def snapshot(opt, args, kwargs):
        seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(snapshot)
    step(trainer)
    return seen


def _assert_same_grads(padded: dict, packed: dict) -> None:
    assert padded.keys() == packed.keys() and padded
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean"])
def test_packed_policy_and_sft_steps_make_the_padded_update(small_model, loss_agg):
    tokens = _long_tail_batch(1)
    with torch.no_grad():
        current, _ = response_logprobs(small_model, tokens)
    g = torch.Generator().manual_seed(2)
    batch = RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=current + 0.6 * (torch.rand(current.shape, generator=g) - 0.5),
        ref_logprobs=current + 0.6 * (torch.rand(current.shape, generator=g) - 0.5),
        advantages=torch.randn(len(tokens), generator=g), rewards=torch.zeros(len(tokens)),
    )  # fmt: skip
    cfg = GRPOConfig(
        loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01, micro_batch_size=5, sampling=SamplingConfig()
    )
    trainers = [
        PolicyTrainer(
            copy.deepcopy(small_model), OPTIM, 10, loss=grpo_loss(cfg), micro_batch_size=5, packed=p
        )
        for p in (False, True)
    ]
    grads = [_grads(t, lambda t: t.policy_step(batch, cfg.kl_coef)) for t in trainers]
    _assert_same_grads(*grads)
    sft = [PolicyTrainer(copy.deepcopy(small_model), OPTIM, 10, packed=p) for p in (False, True)]
    _assert_same_grads(*[_grads(t, lambda t: t.sft_step(tokens, 4)) for t in sft])


def test_packed_dpo_step_makes_the_padded_update(small_model):
    chosen, rejected = _long_tail_batch(3, rows=6), _long_tail_batch(4, rows=6)
    pairs = PairBatch(chosen, rejected, torch.zeros(6))
    with torch.no_grad():
        pairs.ref_chosen = sequence_logprobs(small_model, chosen) - 0.1
        pairs.ref_rejected = sequence_logprobs(small_model, rejected) + 0.1
    trainers = [PolicyTrainer(copy.deepcopy(small_model), OPTIM, 10, packed=p) for p in (False, True)]
    _assert_same_grads(
        *[_grads(t, lambda t: t.dpo_step(pairs, DPOConfig(micro_batch_size=4))) for t in trainers]
    )


def test_packed_scalar_heads_equal_the_padded_forward(small_model):
    tokens = _long_tail_batch(5)
    models = [ScalarModel.from_policy(small_model, packed=p) for p in (False, True)]
    for m in models:  # a head that is not zero, so values differ by position
        torch.nn.init.normal_(m.head.weight, generator=torch.Generator().manual_seed(0))
    models[1].load_state_dict(models[0].state_dict())
    mask = tokens.response_mask.bool()
    with torch.no_grad():
        values = [m.response_values(tokens) for m in models]
        torch.testing.assert_close(values[1][mask], values[0][mask], atol=1e-5, rtol=0)
        scores = [m.last_token_scores(tokens) for m in models]
        torch.testing.assert_close(scores[1], scores[0], atol=1e-5, rtol=0)
    # the critic's and the reward model's steps make the same update
    value_batch = ValueBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_values=values[0], returns=torch.randn(values[0].shape, generator=torch.Generator().manual_seed(1)),
    )  # fmt: skip
    pairs = PairBatch(_long_tail_batch(6, rows=6), _long_tail_batch(7, rows=6), torch.zeros(6))
    for make, batch in (
        (lambda m: CriticTrainer(copy.deepcopy(m), CriticConfig(micro_batch_size=5), 10), value_batch),
        (lambda m: RewardTrainer(copy.deepcopy(m), RewardModelConfig(micro_batch_size=4), 10), pairs),
    ):
        trainers = [make(m) for m in models]
        seen = [record_grads(t.optimizer, t.model) for t in trainers]
        for t in trainers:
            t.step(batch)
        before, (a, b) = (
            dict(models[0].named_parameters()),
            (dict(t.model.named_parameters()) for t in trainers),
        )
        assert_adam_updates_close(  # padded and packed sum in different orders: tests/numerics.py's rule
            before, a, b, lrs=seen[0].lrs, grads_a=seen[0].grads, grads_b=seen[1].grads, grad_atol=1e-6
        )


class LeakyLM(torch.nn.Module):
    """Mixes every earlier token into each position whatever the position ids say: packing would be wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)

    def forward(self, input_ids, position_ids=None, use_cache=None):
        hidden = self.embed(input_ids).cumsum(dim=1)
        return (hidden,)


def test_a_model_that_attends_across_sequences_is_refused_on_its_first_packed_forward():
    ids, mask = torch.tensor([[3, 4], [5, 6]]), torch.ones(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="model.packing: LeakyLM attends across packed sequences"):
        packed_forward(LeakyLM(), pack(ids, mask))
