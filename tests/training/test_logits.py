"""Chunked log-probs (model.logits_chunk_tokens): the head, log_softmax, gather and entropy over a few tokens at a
time give the whole-logits path's values and gradients (float64, within 1e-6 ... in fact to rounding), on every
forward path (padded, shared prompts, packed), with masks, odd chunks and a chunk longer than the sequence; and
no (rows x tokens x vocabulary) tensor is ever made, forward or backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from loopline.data.batches import collate
from loopline.training.logits import head_scores, hidden_states_out
from loopline.training.policy import behaviour_logprobs, response_logprobs

VOCAB = 1000  # bigger than every other dimension here, so a vocabulary-wide tensor is easy to tell apart


def _model(dtype: torch.dtype = torch.float64, vocab: int = VOCAB, tied: bool = True) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype)


def _batch(groups: int = 3, group_size: int = 2, seed: int = 0):
    """Rows of different prompt and response lengths (left and right padding), each prompt group_size times."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(groups):
        prompt = torch.randint(1, VOCAB, (2 + 3 * i,), generator=g).tolist()
        for j in range(group_size):
            prompts.append(prompt)
            responses.append(torch.randint(1, VOCAB, (1 + (5 * i + 3 * j) % 9,), generator=g).tolist())
    return collate(prompts, responses, pad_id=0)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


PATHS = [
    pytest.param({"packed": False, "share_prompts": False}, id="padded"),
    pytest.param({"packed": False, "share_prompts": True}, id="shared-prompts"),
    pytest.param({"packed": True, "share_prompts": False}, id="packed"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk", [1, 7, 10_000])  # one token, odd chunks, a chunk longer than the batch
def test_chunked_logprobs_and_entropy_equal_the_whole_logits_path_values_and_gradients(path, chunk):
    model = _model()
    batch = _batch()
    mask = batch.response_mask
    weights = torch.linspace(-1.0, 2.0, mask.numel(), dtype=torch.float64).view(mask.shape)

    def loss_and_grads(chunk_tokens: int):
        model.zero_grad(set_to_none=True)
        logp, entropy = response_logprobs(model, batch, with_entropy=True, chunk_tokens=chunk_tokens, **path)
        assert entropy is not None
        # a loss of both outputs, masked as the trainers mask: gradients flow through logp and the entropy
        loss = ((logp * weights + 0.3 * entropy) * mask).sum()
        loss.backward()
        return logp.detach() * mask, entropy.detach() * mask, _grads(model)

    whole_logp, whole_entropy, whole_grads = loss_and_grads(0)
    logp, entropy, grads = loss_and_grads(chunk)
    assert logp.dtype == torch.float64  # the head ran in float64: the comparison is of the maths, not fp32
    torch.testing.assert_close(logp, whole_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, whole_entropy, atol=1e-6, rtol=0)
    assert grads.keys() == whole_grads.keys() and "model.embed_tokens.weight" in grads
    for name in grads:
        torch.testing.assert_close(grads[name], whole_grads[name], atol=1e-6, rtol=0, msg=name)
    assert float(whole_logp.abs().sum()) > 0 and float(whole_entropy.sum()) > 0


@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_chunked_behaviour_logprobs_equal_the_whole_logits_path(temperature):
    model = _model().eval()
    batch = _batch()
    with torch.no_grad():
        whole = behaviour_logprobs(model, batch, temperature)
        chunked = behaviour_logprobs(model, batch, temperature, chunk_tokens=5)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a * batch.response_mask, b * batch.response_mask, atol=1e-6, rtol=0)


def test_an_untied_head_gets_its_gradient_through_the_chunks():
    model = _model(tied=False)
    batch = _batch()
    for chunk in (0, 4):
        model.zero_grad(set_to_none=True)
        logp, _ = response_logprobs(model, batch, chunk_tokens=chunk, share_prompts=False)
        (logp * batch.response_mask).sum().backward()
        if chunk == 0:
            whole = model.lm_head.weight.grad.clone()
    torch.testing.assert_close(model.lm_head.weight.grad, whole, atol=1e-6, rtol=0)


def test_the_head_is_restored_after_a_chunked_forward():
    model = _model()
    with hidden_states_out(model) as head:
        hidden = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert head is model.lm_head and hidden.shape == (1, 3, 32)
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, VOCAB)
    empty = head_scores(model.lm_head, hidden[0, :0], torch.zeros(0, dtype=torch.long), chunk=4)
    assert empty.logp.shape == (0,)


class _LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op creates, and whether any has a vocabulary-wide last
    dimension over more than `limit` positions (rows x tokens), forward and backward alike."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.largest_vocab_rows = 0  # the most positions any (..., vocab) tensor spanned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.largest_vocab_rows = max(self.largest_vocab_rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("path", PATHS)
def test_no_rows_by_tokens_by_vocabulary_tensor_exists_in_the_chunked_path(path):
    """Every tensor any op makes in the forward and the backward is seen; the vocabulary-wide ones (those whose
    last dimension is the vocabulary, other than the head's weight and its gradient) must span at most a chunk
    of positions, where the whole-logits path makes them over every row's every position."""
    vocab, chunk = 4099, 6  # a vocabulary no other dimension equals
    model = _model(torch.float32, vocab=vocab)
    batch = _batch(groups=6, group_size=3)
    positions = int(batch.response_mask.sum())  # real response tokens: what even the packed path must score
    assert positions > 2 * max(chunk, model.config.hidden_size)

    def largest(chunk_tokens: int) -> int:
        model.zero_grad(set_to_none=True)
        with _LargestTensor(vocab) as seen:
            logp, entropy = response_logprobs(
                model, batch, with_entropy=True, chunk_tokens=chunk_tokens, **path
            )
            assert entropy is not None
            ((logp + 0.1 * entropy) * batch.response_mask).sum().backward()
        return seen.largest_vocab_rows

    # the weight (vocab, hidden) has `hidden` = 32 "rows" of vocab when transposed: allow that much, no more
    allowed = max(chunk, model.config.hidden_size)
    assert largest(0) >= positions  # the test sees the whole logits when they are made
    assert largest(chunk) <= allowed


def test_the_pipelines_last_stage_chunks_its_head_with_the_same_values_and_gradients():
    """StageModule's (B, L, 2) train channels and (B, L, 3) eval channels, chunked and whole, on a float64 model
    split in two: the last stage holds the head."""
    from loopline.training.pipeline import split_model

    batch = _batch()
    labels = torch.cat([batch.input_ids[:, 1:], torch.zeros_like(batch.input_ids[:, :1])], dim=1)
    first = split_model(_model(), 0, 2)[0]
    with torch.no_grad():
        hidden = first(batch.input_ids, batch.attention_mask, labels)
    results = []
    for chunk in (0, 5):
        last = split_model(_model(), 1, 2)[0]
        last.chunk_tokens = chunk
        h = hidden.clone().requires_grad_(True)
        out = last(h, batch.attention_mask, labels)  # (B, L, 2)
        (out[..., 0] * 0.5 + out[..., 1]).sum().backward()
        last.eval()
        last.temperature = 0.7
        with torch.no_grad():
            evaluated = last(hidden, batch.attention_mask, labels)  # (B, L, 3)
        results.append((out.detach(), h.grad, last.lm_head.weight.grad, evaluated))
    for got, whole in zip(results[1], results[0]):
        torch.testing.assert_close(got, whole, atol=1e-6, rtol=0)
    assert results[0][0].shape[-1] == 2 and results[0][3].shape[-1] == 3


@pytest.mark.parametrize("path", PATHS)
def test_the_backward_keeps_no_chunks_logits(path):
    """What autograd saves for the backward (saved-tensor hooks): the whole-logits path keeps vocabulary-wide
    tensors over every scored position; the chunked path keeps none (each chunk's logits are recomputed), only
    the head's weight, which is the model's anyway."""
    vocab = 4099
    model = _model(torch.float32, vocab=vocab)
    batch = _batch(groups=6, group_size=3)
    weight = model.lm_head.weight

    def kept_vocab_rows(chunk_tokens: int) -> int:
        rows = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal rows
            if t.dim() >= 1 and t.shape[-1] == vocab and t.untyped_storage().data_ptr() != weight.data_ptr():
                rows += t.numel() // vocab
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, entropy = response_logprobs(
                model, batch, with_entropy=True, chunk_tokens=chunk_tokens, **path
            )
        assert entropy is not None
        ((logp + 0.1 * entropy) * batch.response_mask).sum().backward()
        return rows

    assert kept_vocab_rows(0) >= int(batch.response_mask.sum())
    assert kept_vocab_rows(6) == 0


@pytest.mark.parametrize("chunk", [0, 7])
def test_an_entropy_without_a_bonus_costs_backward_no_vocabulary_wide_work(chunk):
    """With no entropy bonus the step's entropy is only a statistic (entropy_grad=False): the same entropies and
    the same gradients (bitwise); chunked, no vocabulary-wide operation of the entropy's runs in backward (a
    zero gradient through it); whole, the forward keeps no vocabulary-wide tensor for the entropy's backward."""
    vocab = 4099
    batch = _batch(groups=4, group_size=3)
    mask = batch.response_mask

    def run(entropy_grad: bool):
        model = _model(torch.float32, vocab=vocab)
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += int(t.dim() >= 1 and t.shape[-1] == vocab)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, entropy = response_logprobs(
                model, batch, with_entropy=True, chunk_tokens=chunk, entropy_grad=entropy_grad
            )
        assert entropy is not None
        with _VocabOps(vocab) as ops:  # no entropy in the loss, as the trainers' with entropy_coef=0
            (logp * mask).sum().backward()
        return entropy.detach() * mask, _grads(model), ops.count, saved

    entropy, grads, ops, saved = run(True)
    statistic, statistic_grads, statistic_ops, statistic_saved = run(False)
    assert torch.equal(statistic, entropy) and float(entropy.sum()) > 0
    assert statistic_grads.keys() == grads.keys()
    for name in grads:
        assert torch.equal(statistic_grads[name], grads[name]), name
    if chunk:
        assert statistic_ops < ops, (statistic_ops, ops)
    else:
        assert statistic_saved < saved, (statistic_saved, saved)


class _VocabOps(TorchDispatchMode):
    """Counts the operations that produce a vocabulary-wide tensor."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[-1] == self.vocab:
            self.count += 1
        return out
