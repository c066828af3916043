"""Real shapes without downloads (model.init=random): the presets' published sizes, the BPE trained here and
padded to a real vocabulary, seeded random init from a config.json, bad input, and a real `loopline train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loopline.cli import main
from loopline.config import ConfigError, ModelConfig, load_config
from loopline.data.config import TaskConfig
from loopline.data.tasks import arithmetic_splits
from loopline.models.load import load_policy, shape_config
from loopline.models.presets import PRESETS
from loopline.models.tokenizer import BPE_TRAINED, bpe_tokenizer, load_tokenizer, train_bpe_tokenizer

# the totals of each model's published weights (tied embeddings counted once)
PUBLISHED = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "qwen3-30b-a3b": 30_532_122_624,  # untied head; 128 experts of 3 x 2048 x 768 in each of 48 layers
    "mixtral-8x7b": 46_702_792_704,  # untied head; 8 experts of 3 x 4096 x 14336 in each of 32 layers
    # scaled down, not published: counted by hand (embeddings and head, per layer attention + norms, 128 experts
    # of 3 x 64 x 32, a 128 x 64 router, two norms; the final norm)
    "qwen3-moe-tiny": 2 * 1024 * 64
    + 2 * (4096 + 2 * 2048 + 4096 + 2 * 16 + 128 * 3 * 64 * 32 + 128 * 64 + 128)
    + 64,
    "mixtral-tiny": 2 * 1024 * 64 + 2 * (4096 + 2 * 2048 + 4096 + 8 * 3 * 64 * 128 + 8 * 64 + 128) + 64,
}
# a scaled-down Qwen2 with a real-sized vocabulary: narrow and shallow, so it trains in seconds
SMALL_WIDE_VOCAB = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32768,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Trained tokenizers go to a cache of the session's own, never the user's ~/.cache."""
    monkeypatch.setenv("LOOPLINE_CACHE", str(tmp_path_factory.getbasetemp() / "loopline-cache"))


def _config_dir(path: Path, **fields: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**SMALL_WIDE_VOCAB, **fields}))
    return path


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_with_their_published_parameter_counts(name):
    config = shape_config(ModelConfig(init="random", preset=name))
    with torch.device("meta"):  # the architecture without allocating a byte of weights
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    tied = PRESETS[name]["tie_word_embeddings"]
    assert model.config.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config.vocab_size == PRESETS[name]["vocab_size"]


def test_bpe_round_trips_the_task_text_and_fills_the_vocabulary():
    tokenizer = bpe_tokenizer(32768)
    assert len(tokenizer) == 32768
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    train, held_out = arithmetic_splits(TaskConfig(), seed=3)  # another seed than the corpus: unseen rows
    texts = [r.prompt + r.completion for r in train[:200] + held_out]
    texts += ["naïve café, 東京 🙂 \t\r\n\x00", "", "  spaces  "]  # byte-level: any text encodes
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert all(i < BPE_TRAINED for i in ids)  # the padding entries are never produced
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # the merges were learned from this text: a task row takes far fewer tokens than its bytes
    row = train[0].prompt + train[0].completion
    assert len(tokenizer(row, add_special_tokens=False)["input_ids"]) <= len(row) // 2


def test_bpe_is_deterministic_and_cached_per_vocabulary_size(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPLINE_CACHE", str(tmp_path))
    first, second = train_bpe_tokenizer(4096), train_bpe_tokenizer(4096)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    bpe_tokenizer(4096)
    cached = tmp_path / "tokenizers" / f"bpe-v1-{BPE_TRAINED}-4096" / "tokenizer.json"
    assert cached.is_file()
    stamp = cached.stat().st_mtime_ns
    again = bpe_tokenizer(4096)  # read back, not trained and written again
    assert cached.stat().st_mtime_ns == stamp
    assert (
        again.backend_tokenizer.to_str()
        == AutoTokenizer.from_pretrained(cached.parent).backend_tokenizer.to_str()
    )
    assert again("123+456=0579\n")["input_ids"] == first("123+456=0579\n")["input_ids"]
    assert sorted(p.name for p in (tmp_path / "tokenizers").iterdir()) == [f"bpe-v1-{BPE_TRAINED}-4096"]


def test_random_init_is_seeded_and_takes_the_config_vocabulary(tmp_path):
    cfg = ModelConfig(init="random", config=str(_config_dir(tmp_path / "shape")))
    state = torch.random.get_rng_state()
    a, tok = load_policy(cfg, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # building did not move the caller's RNG
    b, _ = load_policy(cfg, seed=0)
    c, _ = load_policy(cfg, seed=1)
    assert a.get_input_embeddings().weight.shape == (32768, 32) and len(tok) == 32768
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)
    assert (a.config.pad_token_id, a.config.bos_token_id, a.config.eos_token_id) == (0, 1, 2)


def test_a_local_tokenizer_dir_is_used(tmp_path):
    bpe_tokenizer(1024).save_pretrained(tmp_path / "tok")
    cfg = ModelConfig(
        init="random", config=str(_config_dir(tmp_path / "shape")), tokenizer=str(tmp_path / "tok")
    )
    _, tok = load_policy(cfg)
    assert len(tok) == 1024  # the local one, not a BPE padded to the config's 32768


def test_a_saved_tokenizer_loads_as_saved_beside_a_qwen_config(tmp_path):
    """AutoTokenizer would rebuild a Qwen2Tokenizer from a directory with a qwen2 config.json: digits split one
    by one and an extra unknown token. load_tokenizer keeps the saved tokenizer as it was."""
    tokenizer = bpe_tokenizer(1024)
    tokenizer.save_pretrained(tmp_path)
    _config_dir(tmp_path, vocab_size=1024)
    row = "123+456=0579\n"
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 1025  # what the plain loader makes of it
    loaded = load_tokenizer(tmp_path)
    assert len(loaded) == 1024 and loaded(row)["input_ids"] == tokenizer(row)["input_ids"]


def test_config_rejects_bad_shapes():
    with pytest.raises(ConfigError, match="unknown preset 'qwen9'; known: qwen2.5-0.5b, qwen2.5-1.5b"):
        load_config(overrides=["model.init=random", "model.preset=qwen9"])
    with pytest.raises(ConfigError, match="model.preset gives a shape, not weights"):
        load_config(overrides=["model.preset=qwen2.5-0.5b"])
    with pytest.raises(ConfigError, match="model.init=random needs a shape"):
        load_config(overrides=["model.init=random"])
    # a preset's layers, not model.tiny's, decide whether a pipeline split is even
    load_config(overrides=["model.init=random", "model.preset=qwen2.5-0.5b", "model.tiny.num_layers=3"])


def _fails(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_cli_bad_shapes_exit_2_with_one_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", f"out_dir={out}", "progress=false", "tensorboard=false"]
    err = _fails([*base, "model.init=random", "model.preset=qwen9"], capsys)
    assert "model.preset" in err and "qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b, llama-3.2-1b" in err
    encoder = _config_dir(tmp_path / "t5", model_type="t5")
    err = _fails([*base, "model.init=random", f"model.config={encoder}"], capsys)
    assert "model.config" in err and "'t5', not a causal LM" in err
    narrow = _config_dir(tmp_path / "narrow", vocab_size=300)
    err = _fails([*base, "model.init=random", f"model.config={narrow}"], capsys)
    assert "model.config: vocab_size 300 is smaller than the tokenizer's 512 tokens" in err
    err = _fails([*base, "model.init=random", f"model.config={tmp_path / 'absent'}"], capsys)
    assert "model.config" in err and "does not exist" in err
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.e2e
def test_train_and_generate_at_a_real_vocabulary_size(tmp_path, capsys):
    shape = _config_dir(tmp_path / "shape")
    out = tmp_path / "run"
    args = [
        "model.init=random", f"model.config={shape}", f"out_dir={out}",
        "sft.steps=1", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0",
        "grpo.steps=2", "grpo.prompts_per_step=4", "grpo.group_size=2", "grpo.micro_batch_size=8",
        "grpo.eval_every=0", "grpo.sampling.max_new_tokens=8", "eval.sampling.max_new_tokens=8",
        "data.task.num_train=64", "data.task.num_eval=8", "eval.num_prompts=8",
        "progress=false", "tensorboard=false", "threads=1",
    ]  # fmt: skip
    assert main(["train", *args]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "grpo" and "loss" in r]
    assert len(rl) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rl)
    exported = tmp_path / "exported"
    assert main(["export", str(out), str(exported)]) == 0
    trained = AutoModelForCausalLM.from_pretrained(exported)
    start, _ = load_policy(ModelConfig(init="random", config=str(shape)), seed=0)
    tokenizer = load_tokenizer(exported)
    assert trained.config.vocab_size == 32768 and len(tokenizer) == 32768
    row = "123+456=0579\n"
    assert tokenizer(row)["input_ids"] == bpe_tokenizer(32768)(row)["input_ids"]
    moved = [n for n, p in start.named_parameters() if not torch.equal(p, trained.get_parameter(n))]
    assert "model.layers.0.mlp.up_proj.weight" in moved
    capsys.readouterr()
    assert main(["generate", "model.init=random", f"model.config={shape}", "--prompt", "1+2="]) == 0
    assert capsys.readouterr().out.strip()
    # the run directory first: its trained weights, not a new random model from the run's shape settings
    assert main(["eval", str(out)]) == 0
    assert "eval_accuracy" in json.loads(capsys.readouterr().out.splitlines()[-1])
