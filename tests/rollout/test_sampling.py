"""The next-token draw (rollout/sampling.py): top-k / top-p filtering, the inverse-CDF sampler, greedy decoding."""

from __future__ import annotations

import torch

from loopline.rollout.sampling import filter_logits, next_tokens, sample_tokens


def test_filter_logits_top_k_and_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()

    def kept(top_k, top_p):
        return torch.isfinite(filter_logits(logits, top_k, top_p))[0].tolist()

    # sorted: 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95; drop when it reaches top_p
    assert kept(0, 0.7) == [False, True, False, True]  # 0.5 < 0.7 keeps the 0.3 token
    assert kept(0, 0.5) == [False, True, False, False]  # 0.5 >= 0.5 drops it
    assert kept(0, 0.81) == [False, True, True, True]
    assert kept(0, 1e-9) == [False, True, False, False]  # the top token always stays
    assert kept(2, 1.0) == [False, True, False, True]
    assert kept(3, 0.7) == [False, True, False, True]  # both filters apply
    assert kept(0, 1.0) == [True] * 4 and kept(4, 1.0) == [True] * 4
    # kept logits are unchanged: the engine renormalises with log_softmax
    assert torch.equal(filter_logits(logits, 2, 1.0)[0, [1, 3]], logits[0, [1, 3]])


def test_sample_tokens_draws_each_token_at_its_probability_and_never_a_filtered_one():
    # zeros first, between and last, as top-k and top-p leave them
    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])
    rows = 200_000
    logp = probs.log().expand(rows, -1)
    drawn = sample_tokens(logp, torch.Generator().manual_seed(0))
    assert drawn.shape == (rows,) and drawn.dtype == torch.long
    freq = torch.bincount(drawn, minlength=len(probs)).double() / rows
    assert freq[probs == 0].sum() == 0
    sigma = (probs * (1 - probs) / rows).sqrt().double()
    assert torch.all((freq - probs.double()).abs() <= 5 * sigma + 1e-12), freq
    # one token left: always it, wherever it sits; a seeded generator repeats its draws
    for only in (0, 5):
        one = torch.full((8, 6), float("-inf"))
        one[:, only] = 0.0
        assert sample_tokens(one, None).tolist() == [only] * 8
    assert torch.equal(drawn, sample_tokens(logp, torch.Generator().manual_seed(0)))


def test_next_tokens_is_greedy_at_temperature_0_and_draws_from_the_filtered_distribution_otherwise():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    token, logp = next_tokens(logits, 0.0, 0, 1.0, None)
    assert token.tolist() == [1, 2] and torch.allclose(logp, torch.log_softmax(logits, -1))
    # top_k=1 leaves one token a row: drawn whatever the generator, its log-prob 0, the others -inf
    token, logp = next_tokens(logits, 0.7, 1, 1.0, torch.Generator().manual_seed(0))
    assert token.tolist() == [1, 2]
    assert logp[0, 1] == 0 and torch.isinf(logp[0, [0, 2, 3]]).all()
    # the temperature scales the logits before the softmax
    _, logp = next_tokens(logits, 2.0, 0, 1.0, torch.Generator().manual_seed(0))
    assert torch.allclose(logp, torch.log_softmax(logits / 2.0, -1))
