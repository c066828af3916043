"""The byte tokenizer and the built-in model: round trips through HF save/load, determinism, loading."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loopline.config import ModelConfig
from loopline.models import build_tiny_model, load_policy

TEXTS = [
    "12+345=357\n",
    "naïve café, 東京, Ελληνικά, emoji 🙂👍🏽, zero-width\u200bjoiner",
    "  leading and trailing spaces \t\r\n\n",
    "\x00\x01 control bytes \x7f",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    # one token per UTF-8 byte, after <bos>; ids 0-2 are pad/bos/eos so bytes map to 3..258
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert all(3 <= i < 259 for i in ids[1:])
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_byte_tokenizer_random_unicode_round_trip(tokenizer):
    g = torch.Generator().manual_seed(0)
    # random code points from the BMP and beyond, skipping the surrogate range that UTF-8 cannot hold
    points = torch.randint(1, 0x2FFFF, (2000,), generator=g).tolist()
    text = "".join(chr(p) for p in points if not 0xD800 <= p <= 0xDFFF)
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


def test_byte_tokenizer_specials(tokenizer):
    assert len(tokenizer) == 259
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "left"
    # every one of the 256 bytes has its own id
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokenizer.convert_ids_to_tokens(list(range(3, 259)))}
    assert ids == set(range(3, 259))
    singles = [
        tokenizer(bytes([b]).decode("latin-1"), add_special_tokens=False)["input_ids"] for b in range(128)
    ]
    assert all(len(s) == 1 for s in singles) and len({s[0] for s in singles}) == 128


def test_tokenizer_save_and_auto_load_give_the_same_ids(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    batch = loaded(["1+1=", "10+10="], padding=True)["input_ids"]
    assert batch[0][:2] == [0, 0]  # left padding survives the round trip


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_model_is_deterministic_per_seed(tokenizer, small_cfg):
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    a = build_tiny_model(small_cfg, tokenizer, seed=3)
    assert torch.equal(torch.get_rng_state(), rng)  # building a model leaves the caller's RNG alone
    b = build_tiny_model(small_cfg, tokenizer, seed=3)
    c = build_tiny_model(small_cfg, tokenizer, seed=4)
    assert _same_weights(a, b)
    assert not _same_weights(a, c)
    assert a.config.vocab_size == len(tokenizer) and a.config.tie_word_embeddings


def test_load_policy_default_is_the_builtin_model():
    model, tok = load_policy(ModelConfig(), seed=0)
    assert len(tok) == 259 and tok.padding_side == "left"
    assert model.config.hidden_size == ModelConfig().tiny.hidden_size
    assert model.dtype == torch.float32
    model16, _ = load_policy(ModelConfig(dtype="bfloat16"), seed=0)
    assert model16.dtype == torch.bfloat16


def test_load_policy_from_saved_dir_gives_identical_logits(tokenizer, small_model, tmp_path):
    small_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tok = load_policy(ModelConfig(path=str(tmp_path)))
    assert tok.padding_side == "left" and tok.pad_token_id == 0
    ids = torch.tensor([tokenizer("12+34=46")["input_ids"]])
    small_model.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, small_model(input_ids=ids).logits)
    assert _same_weights(model, small_model)
    # and plain transformers reads the directory too
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), type(small_model))


def test_load_policy_rejects_a_non_model_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match=r"model.path .* is not a Hugging Face model directory"):
        load_policy(ModelConfig(path=str(tmp_path)))
    with pytest.raises(ValueError, match="model.path"):
        load_policy(ModelConfig(path=str(tmp_path / "missing")))
