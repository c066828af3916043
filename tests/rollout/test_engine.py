"""TorchEngine against Hugging Face generate and a plain forward pass, on the built-in architecture."""

from __future__ import annotations

import copy

import pytest
import torch

from loopline.config import OptimConfig, TaskConfig
from loopline.data.batches import collate
from loopline.data.tasks import arithmetic_splits
from loopline.models.load import build_tiny_model
from loopline.rollout.engine import SamplingParams, TorchEngine
from loopline.training.policy import PolicyTrainer

PROMPTS_TEXT = ["7+5=", "12+30=", "4+91=", "3+3=", "60+9="]  # 5 to 7 tokens with <bos>: padding varies


@pytest.fixture(scope="module")
def trained(tokenizer, small_cfg):
    """The small model after 60 SFT steps on 1-2 digit addition: it writes digits, '\\n' and EOS."""
    model = build_tiny_model(small_cfg, tokenizer, seed=0)
    rows, _ = arithmetic_splits(
        TaskConfig(max_digits=2, num_train=500, num_eval=10, teacher_drops_carries=0.0), seed=0
    )
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-2, warmup_steps=0), total_steps=60)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        picks = torch.randint(len(rows), (32,), generator=g).tolist()
        prompts = [tokenizer(rows[i].prompt)["input_ids"] for i in picks]
        targets = [tokenizer(rows[i].completion, add_special_tokens=False)["input_ids"] + [2] for i in picks]
        trainer.sft_step(collate(prompts, targets, 0), 32)
    return model.eval()


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in PROMPTS_TEXT]


def _hf_greedy(model, tokenizer, max_new: int) -> list[list[int]]:
    """HF generate on the same prompts, left-padded; each row cut after its first EOS."""
    enc = tokenizer(PROMPTS_TEXT, padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any(), "the prompts must need padding for this test to mean anything"
    out = model.generate(
        **enc, do_sample=False, max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    rows = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        rows.append(row[: row.index(2) + 1] if 2 in row else row)
    return rows


@pytest.mark.parametrize("which", ["random", "trained"])
def test_greedy_matches_hf_generate(request, tokenizer, which):
    model = request.getfixturevalue("small_model" if which == "random" else "trained")
    engine = TorchEngine(model, tokenizer)
    got = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=10, temperature=0.0))
    expected = _hf_greedy(model, tokenizer, 10)
    assert [c.token_ids for c in got] == expected
    for c, e in zip(got, expected):
        assert c.finish_reason == ("stop" if e[-1] == tokenizer.eos_token_id else "length")
    if which == "trained":  # the trained model really does stop on EOS
        assert any(c.finish_reason == "stop" for c in got)


def test_batched_greedy_equals_one_prompt_at_a_time(trained, tokenizer):
    engine = TorchEngine(trained, tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    batched = engine.generate(_prompts(tokenizer), params)
    for i, p in enumerate(_prompts(tokenizer)):
        assert engine.generate([p], params)[0].token_ids == batched[i].token_ids


def test_logprobs_match_a_forward_pass(small_model, tokenizer):
    engine = TorchEngine(small_model, tokenizer)
    completions = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=6, seed=3), n=2)
    for c in completions:
        prompt = _prompts(tokenizer)[c.prompt_index]
        with torch.no_grad():
            logits = small_model(input_ids=torch.tensor([prompt + c.token_ids])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        # token k of the completion is predicted at position len(prompt) - 1 + k
        positions = torch.arange(len(c.token_ids)) + len(prompt) - 1
        expected = logp[positions, torch.tensor(c.token_ids)]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)


def test_shared_prefill_and_rows_leaving_keep_logprobs_exact(small_model, tokenizer):
    # one prefill per prompt shared by its samples, and finished rows dropped from the cache: every
    # sample's log-probs must still be those of a plain forward pass over its own prompt and tokens
    engine = TorchEngine(small_model, tokenizer)
    prompts = _prompts(tokenizer)
    stop = tuple("0123456789")  # ends samples early and at different steps
    out = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=5, stop=stop), n=4)
    lengths = {len(c.token_ids) for c in out}
    assert len(lengths) > 3 and any(c.finish_reason == "stop" for c in out)  # a real spread of lengths
    assert any(c.finish_reason == "length" for c in out)
    for c in out:
        ids = torch.tensor([prompts[c.prompt_index] + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(small_model(input_ids=ids).logits[0].float(), -1)
        positions = torch.arange(len(c.token_ids)) + len(prompts[c.prompt_index]) - 1
        torch.testing.assert_close(
            torch.tensor(c.logprobs), logp[positions, torch.tensor(c.token_ids)], atol=1e-5, rtol=0
        )
        if c.finish_reason == "stop":  # stops at its first digit, and only there
            assert c.text[-1].isdigit() and not any(ch.isdigit() for ch in c.text[:-1])


def test_prompts_are_prefilled_once_and_finished_rows_leave_the_batch(small_model, tokenizer):
    rows_per_forward = []
    hook = small_model.register_forward_pre_hook(
        lambda _, args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        out = TorchEngine(small_model, tokenizer).generate(
            _prompts(tokenizer), SamplingParams(max_new_tokens=16, seed=1, stop=tuple("0123456789")), n=8
        )
    finally:
        hook.remove()
    assert rows_per_forward[0][0] == len(PROMPTS_TEXT)  # the prefill: 5 prompts, not 40 rows
    decode = [shape[0] for shape in rows_per_forward[1:]]
    # each decode step runs the rows still generating, and the finished ones only while they are fewer than
    # a quarter of the batch (then they leave it)
    still = [sum(len(c.token_ids) > k for c in out) for k in range(1, len(decode) + 1)]
    assert all(s <= d and (d - s) * 4 < d for d, s in zip(decode, still)), (decode, still)
    assert decode == sorted(decode, reverse=True) and decode[-1] < 40


def _digit_prompts(tokenizer, count: int) -> list[list[int]]:
    rows, _ = arithmetic_splits(TaskConfig(num_train=count, num_eval=2, num_val=2), seed=3)
    return [tokenizer(r.prompt)["input_ids"] for r in rows]


@pytest.mark.parametrize("max_rows", [2, 6, 15])
def test_continuous_batching_gives_each_sample_what_the_whole_batch_at_once_gives(
    trained, tokenizer, max_rows
):
    # greedy, so a sample does not depend on its batch: the same tokens however many rows compute at once, and
    # log-probs within float noise (other padding, other batch shapes)
    prompts = _digit_prompts(tokenizer, 12)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop=("\n",))
    whole = TorchEngine(trained, tokenizer).generate(prompts, params, n=2)
    assert len({len(c.token_ids) for c in whole}) > 1  # a spread of lengths: rows free at different steps
    capped = TorchEngine(trained, tokenizer, max_rows=max_rows).generate(prompts, params, n=2)
    for a, b in zip(whole, capped):
        assert (a.prompt_index, a.sample_index, a.token_ids, a.finish_reason) == (
            b.prompt_index, b.sample_index, b.token_ids, b.finish_reason,
        )  # fmt: skip
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


def test_waiting_prompts_take_freed_rows_and_the_cache_stays_bounded(small_model, tokenizer):
    # 24 prompts x 2 samples through 8 rows at T=1 with digits as stops: most samples end within a few tokens,
    # a few run to 30. Every forward holds at most 8 rows; prompts enter while long samples still run (a
    # prefill after decode steps of other rows), and the cache spans at most a prompt and its completion
    shapes = []
    hook = small_model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append((kwargs["input_ids"].shape, kwargs["attention_mask"].shape[1])),
        with_kwargs=True,
    )
    prompts = _digit_prompts(tokenizer, 24)
    params = SamplingParams(max_new_tokens=30, seed=2, stop=tuple("0123456789"))
    try:
        out = TorchEngine(small_model, tokenizer, max_rows=8).generate(prompts, params, n=2)
    finally:
        hook.remove()
    assert all(rows <= 8 for (rows, _), _ in shapes)
    prefills = [i for i, ((_, width), _) in enumerate(shapes) if width > 1]
    assert len(prefills) > 3 and prefills[1] > 1  # groups enter one after another, between decode steps
    longest = max(len(c.token_ids) for c in out)
    assert longest > 10 and len(shapes) - len(prefills) < 24 * longest / 4  # far fewer steps than in sequence
    # the cache never spans more than a prompt and two completions (columns left of every row's are dropped)
    assert max(columns for _, columns in shapes) <= max(map(len, prompts)) + 2 * params.max_new_tokens + 1
    assert sorted((c.prompt_index, c.sample_index) for c in out) == [
        (p, s) for p in range(24) for s in range(2)
    ]


def test_max_rows_below_a_group_is_refused(small_model, tokenizer):
    with pytest.raises(ValueError, match=r"engine max_rows \(3\) is below the 4 samples of one prompt"):
        TorchEngine(small_model, tokenizer, max_rows=3).generate(_prompts(tokenizer), SamplingParams(), n=4)
    with pytest.raises(ValueError, match="max_rows must be at least 0"):
        TorchEngine(small_model, tokenizer, max_rows=-1)


def test_stop_strings_are_matched_as_decoding_every_token_would(small_model):
    # the matcher decodes only after a token whose text holds a stop string's last character; on random
    # sequences over a BPE vocabulary with merges it must stop exactly where decoding every token stops
    from loopline.rollout.engine import _StopMatcher

    tok = _bpe_with_merges()
    pieces = tok.batch_decode([[t] for t in range(len(tok))])
    g = torch.Generator().manual_seed(0)
    vocab = [t for t in range(len(tok)) if t != tok.eos_token_id]
    for stop in [("\n",), ("\n\n",), ("b\n",), ("ab", "\nc"), ("d",)]:
        matcher = _StopMatcher(tok, stop, pieces)
        for _ in range(60):
            seq = [vocab[i] for i in torch.randint(len(vocab), (30,), generator=g).tolist()]
            expected = next(
                (k for k in range(1, 31) if any(s in tok.decode(seq[:k][-32:]) for s in stop)), None
            )
            got = next(
                (
                    k
                    for k in range(1, 31)
                    if bool(matcher.stops(torch.tensor(seq[k - 1 : k]))[0])
                    or (bool(matcher.may_complete(torch.tensor(seq[k - 1 : k]))[0]) and matcher.hit(seq[:k]))
                ),
                None,
            )
            assert got == expected, (stop, seq)
    merged = tok.convert_tokens_to_ids("ĊĊ")  # "\n\n", one token
    newline_stop = _StopMatcher(tok, ("\n",), pieces)
    assert bool(newline_stop.may_complete(torch.tensor([merged]))[0])
    letters = torch.tensor(tok.encode("abcd", add_special_tokens=False))
    assert not newline_stop.may_complete(letters).any()  # no decode for tokens that cannot end a match


def _bpe_with_merges():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=264, special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator(["a\n\nb\n\nc\n\nd\n\nab\n"] * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def test_n_samples_per_prompt_are_indexed(small_model, tokenizer):
    engine = TorchEngine(small_model, tokenizer)
    out = engine.generate(_prompts(tokenizer)[:3], SamplingParams(max_new_tokens=4, seed=0), n=4)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(3) for s in range(4)]
    # samples of one prompt are different draws, not copies of one
    assert len({tuple(c.token_ids) for c in out if c.prompt_index == 0}) > 1


def test_single_token_stop_string_ends_generation_and_is_kept(trained, tokenizer):
    engine = TorchEngine(trained, tokenizer)
    free = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=10, temperature=0.0))
    stopped = engine.generate(
        _prompts(tokenizer), SamplingParams(max_new_tokens=10, temperature=0.0, stop=("\n",))
    )
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    assert any(newline in f.token_ids[:-1] for f in free)  # the model writes more after a newline (EOS)
    for f, s in zip(free, stopped):
        if newline in f.token_ids:
            assert s.token_ids == f.token_ids[: f.token_ids.index(newline) + 1]
            assert s.text.endswith("\n") and s.finish_reason == "stop"
        else:
            assert s.token_ids == f.token_ids
    assert any(len(s.token_ids) < len(f.token_ids) for f, s in zip(free, stopped))


def test_multi_token_stop_string_ends_generation_and_is_kept(trained, tokenizer):
    engine = TorchEngine(trained, tokenizer)
    free = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=10, temperature=0.0))
    # a two-character stop string (two byte tokens) taken from the start of the longest greedy answer
    k = max(range(len(free)), key=lambda i: len(free[i].text))
    stop = free[k].text[:2]
    assert len(tokenizer.encode(stop, add_special_tokens=False)) == 2
    stopped = engine.generate(
        _prompts(tokenizer), SamplingParams(max_new_tokens=10, temperature=0.0, stop=(stop,))
    )
    assert stopped[k].token_ids == free[k].token_ids[:2]
    assert len(stopped[k].token_ids) < len(free[k].token_ids)  # it really cut the generation short
    assert stopped[k].text == stop and stopped[k].finish_reason == "stop"
    for f, s in zip(free, stopped):  # every row stops at its own first occurrence, or not at all
        cut = f.text.find(stop)
        assert s.text == (f.text if cut < 0 else f.text[: cut + len(stop)])


def test_max_new_tokens_gives_length(small_model, tokenizer):
    engine = TorchEngine(small_model, tokenizer)
    out = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=3, temperature=0.0))
    for c in out:
        if tokenizer.eos_token_id not in c.token_ids:
            assert len(c.token_ids) == 3 and c.finish_reason == "length"
    assert any(c.finish_reason == "length" for c in out)


def test_ignore_eos_samples_from_the_distribution_without_eos(trained, tokenizer):
    engine = TorchEngine(trained, tokenizer, seed=0)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    eos = tokenizer.eos_token_id
    assert any(eos in c.token_ids for c in engine.generate(_prompts(tokenizer), params, n=4))
    out = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=6, ignore_eos=True), n=4)
    assert all(eos not in c.token_ids and len(c.token_ids) == 6 for c in out)
    for c in out[:4]:  # each token's log-prob is over the vocabulary less EOS
        prompt = _prompts(tokenizer)[c.prompt_index]
        with torch.no_grad():
            logits = trained(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
        logits[:, eos] = float("-inf")
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_equal_greedy(small_model, tokenizer, params):
    engine = TorchEngine(small_model, tokenizer)
    greedy = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=6, temperature=0.0))
    sampled = engine.generate(
        _prompts(tokenizer), SamplingParams(max_new_tokens=6, temperature=1.0, seed=1, **params)
    )
    assert [c.token_ids for c in sampled] == [c.token_ids for c in greedy]
    # only one token survives the filter: it has probability 1
    assert all(lp == pytest.approx(0.0, abs=1e-6) for c in sampled for lp in c.logprobs)


def test_seeded_sampling_is_reproducible_and_leaves_global_rng_alone(small_model, tokenizer):
    engine = TorchEngine(small_model, tokenizer)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    a = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=6, seed=7), n=2)
    assert torch.equal(torch.get_rng_state(), rng)
    b = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=6, seed=7), n=2)
    c = engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=6, seed=8), n=2)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_a_restored_generator_state_samples_the_same_tokens_again(small_model, tokenizer):
    # what a checkpoint keeps of an engine (rng_state) and a resume gives back (set_rng_state, through
    # runtime.engine.restore_engine_rng on both backends): the samples after it, token for token
    from loopline.runtime.engine import restore_engine_rng

    prompts, params = _prompts(tokenizer), SamplingParams(max_new_tokens=6, temperature=1.0)
    engine = TorchEngine(small_model, tokenizer, seed=5)
    engine.generate(prompts, params, n=2)  # the stream has moved off its seed
    saved = engine.rng_state()

    def sample() -> list[list[int]]:
        return [c.token_ids for c in engine.generate(prompts, params, n=2)]

    first, second = sample(), sample()
    assert first != second  # the stream moves on
    engine.set_rng_state(saved)
    assert sample() == first
    # the restore a resume runs: the saved states fit (as many engines, each with a generator): exact
    assert restore_engine_rng(engine, [None, saved], rank=1, engines=2, reseed=99)
    assert sample() == first
    # they do not fit (another number of engines): reseeded from reseed + rank, and said so
    assert not restore_engine_rng(engine, [saved], rank=1, engines=2, reseed=99)
    reseeded = sample()
    engine.reseed(100)
    assert reseeded == sample() != first


def test_update_weights_copies_bitwise_and_bumps_version(small_model, trained, tokenizer):
    engine = TorchEngine(copy.deepcopy(small_model), tokenizer)
    engine.update_weights(trained.state_dict(), version=5)
    assert engine.version == 5
    mine, theirs = engine.model.state_dict(), trained.state_dict()
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    # the copies are the engine's own: training the source afterwards does not leak into the engine
    assert engine.model.model.embed_tokens.weight.data_ptr() != trained.model.embed_tokens.weight.data_ptr()
    out = engine.generate(_prompts(tokenizer)[:1], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert out[0].policy_version == 5
    assert out[0].token_ids == _hf_greedy(trained, tokenizer, 2)[0]
    with pytest.raises(KeyError, match="no parameter"):
        engine.update_weights({"not.a.weight": torch.zeros(1)}, version=6)


@pytest.mark.parametrize("max_rows", [0, 8])
def test_no_sample_comes_from_state_left_by_earlier_weights(small_model, trained, tokenizer, max_rows):
    """Async RL syncs weights between generate calls: an engine that generated under other weights (its KV cache
    filled, its stop tables built) then took new ones samples exactly what a fresh engine with the new ones does,
    and says which version it sampled under. The engine keeps no KV or prefix cache across calls."""
    params = SamplingParams(max_new_tokens=6, seed=3, stop=("\n",))
    used = TorchEngine(copy.deepcopy(small_model), tokenizer, max_rows=max_rows)
    used.generate(_prompts(tokenizer), params, n=4)  # under the old weights
    used.update_weights(trained.state_dict(), version=7)
    fresh = TorchEngine(copy.deepcopy(trained), tokenizer, max_rows=max_rows)
    a, b = used.generate(_prompts(tokenizer), params, n=4), fresh.generate(_prompts(tokenizer), params, n=4)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    assert {c.policy_version for c in a} == {7}


def test_generate_rejects_empty_prompts_and_restores_train_mode(small_model, tokenizer):
    engine = TorchEngine(small_model, tokenizer)
    with pytest.raises(ValueError, match="non-empty"):
        engine.generate([[1, 5], []], SamplingParams())
    small_model.train()
    engine.generate([[1, 5]], SamplingParams(max_new_tokens=1))
    assert small_model.training


def test_stop_string_inside_a_merged_token(small_cfg):
    # Real BPE vocabularies merge "\n" into longer tokens ("\n\n", ".\n"). A stop string that is one
    # token on its own must still end generation when it arrives inside such a merged token.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from loopline.models.load import build_tiny_model

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # 3 specials + 256 bytes + exactly one merge: the most frequent pair, "\n" "\n"
    trainer = trainers.BpeTrainer(
        vocab_size=260, special_tokens=["<pad>", "<bos>", "<eos>"], initial_alphabet=alphabet
    )
    bpe.train_from_iterator(["a\n\nb\n\nc\n\nd\n\n"] * 20, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    target = tok.encode("7\n\n8", add_special_tokens=False) + [tok.eos_token_id]
    assert len(target) == 4 and len(tok.encode("\n", add_special_tokens=False)) == 1  # "7", "\n\n", "8", eos

    model = build_tiny_model(small_cfg, tok, seed=0)
    trainer_ = PolicyTrainer(model, OptimConfig(lr=1e-2, warmup_steps=0), total_steps=40)
    prompt = [tok.bos_token_id] + tok.encode("q", add_special_tokens=False)
    for _ in range(40):  # memorise the one completion
        trainer_.sft_step(collate([prompt] * 4, [target] * 4, tok.pad_token_id), 4)
    engine = TorchEngine(model, tok)
    free = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert free.token_ids == target
    stopped = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=("\n",)))[0]
    assert stopped.token_ids == target[:2] and stopped.text == "7\n\n"
    assert stopped.finish_reason == "stop"


def _offer_after(engine: TorchEngine, forwards: int, weights: dict, version: int):
    """Offer `weights` to `engine` once its model has run `forwards` forwards (the prefill is the first), as the
    weight sync does from another thread while a generate call runs: the engine takes them at its next step."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == forwards:
            engine.offer_weights(weights, version)

    return engine.model.register_forward_hook(hook)


@pytest.mark.parametrize("max_rows", [0, 8])
def test_partial_rollout_goes_on_under_new_weights_with_recomputed_kv(
    small_model, trained, tokenizer, max_rows
):
    """Weights arriving mid-call: tokens sampled so far keep their old version; every later token is what the new
    weights give from the whole prefix (greedy: the new engine's continuation of that prefix), with the new
    weights' log-probs; no token comes from keys and values the old weights computed."""
    old, new = copy.deepcopy(small_model), trained
    engine = TorchEngine(old, tokenizer, max_rows=max_rows)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = _digit_prompts(tokenizer, 6)
    handle = _offer_after(engine, 3, new.state_dict(), version=1)  # after the prefill and 2 decode steps
    try:
        got = engine.generate(prompts, params, n=2)
    finally:
        handle.remove()
    assert engine.version == 1
    fresh = TorchEngine(new, tokenizer)
    switched = 0
    for c in got:
        versions = c.token_versions
        assert len(versions) == len(c.token_ids) and versions == sorted(versions)
        assert c.policy_version == versions[0] and c.partial == (versions[0] != versions[-1])
        first_new = versions.index(1) if 1 in versions else len(versions)
        prefix = prompts[c.prompt_index] + c.token_ids[:first_new]
        if first_new < len(c.token_ids):
            switched += 1
            rest = fresh.generate([prefix], SamplingParams(max_new_tokens=8 - first_new, temperature=0.0))[0]
            assert c.token_ids[first_new:] == rest.token_ids
            assert c.logprobs[first_new:] == pytest.approx(rest.logprobs, abs=1e-5)
    assert switched >= 4 and any(c.partial for c in got)


def test_partial_rollout_keeping_stale_kv_differs_from_recomputing(small_model, trained, tokenizer):
    """keep_stale_kv is what it says: the sequences in flight go on from the old weights' cache, so their tokens
    differ from the recomputed ones (here, on these weights); the version of each token is recorded alike."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = _digit_prompts(tokenizer, 6)
    runs = {}
    for keep in (False, True):
        engine = TorchEngine(copy.deepcopy(small_model), tokenizer, keep_stale_kv=keep)
        handle = _offer_after(engine, 3, trained.state_dict(), version=1)
        try:
            runs[keep] = engine.generate(prompts, params, n=2)
        finally:
            handle.remove()
    switches = {keep: [c.token_versions.count(0) for c in run] for keep, run in runs.items()}
    assert switches[True] == switches[False] and max(switches[True]) >= 2
    assert [c.logprobs for c in runs[True]] != [c.logprobs for c in runs[False]]


def test_weights_offered_while_idle_load_at_once(small_model, trained, tokenizer):
    engine = TorchEngine(copy.deepcopy(small_model), tokenizer)
    engine.offer_weights(trained.state_dict(), version=4)
    engine.wait_taken()
    assert engine.version == 4
    for name, t in trained.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name
