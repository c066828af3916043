"""The built-in byte tokenizer (every UTF-8 byte is one token, plus pad/bos/eos), and a byte-level BPE of any
vocabulary size for models built from a real shape (model.init=random), trained here so nothing is downloaded.

Made with the `tokenizers` library and wrapped as a real PreTrainedTokenizerFast, so
save_pretrained/from_pretrained round-trip and any HF tooling accepts it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer with no merges (ids 0-2 are pad/bos/eos)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins, one per byte
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for byte_char in sorted(alphabet):
        vocab[byte_char] = len(vocab)
    return _byte_level(vocab, [])


def _byte_level(
    vocab: dict[str, int], merges: list[tuple[str, str]], add_specials: bool = False
) -> PreTrainedTokenizerFast:
    """A byte-level BPE over `vocab` and `merges` with pad/bos/eos, every encoding starting with <bos>."""
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if add_specials:  # a trained vocabulary: never split pad/bos/eos as text
        tok.add_special_tokens([PAD, BOS, EOS])
    # encode(text) starts with <bos>, so a prompt always has at least one token to condition on
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    # padding_side given here (not set afterwards) so that save_pretrained records it
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


# ---------------------------------------------------------------- a BPE of a real model's vocabulary size

BPE_TRAINED = 512  # tokens learned from the task's text (specials + 256 bytes + merges); the rest are unused
BPE_VERSION = 1  # bump when the recipe changes: cached tokenizers of another version are not reused


def cache_root() -> Path:
    """Where trained tokenizers are kept: $LOOPLINE_CACHE, else ~/.cache/loopline."""
    return Path(os.environ.get("LOOPLINE_CACHE") or Path.home() / ".cache" / "loopline")


def bpe_corpus() -> list[str]:
    """The text the BPE learns its merges from: the built-in task's training rows (default task, seed 0),
    fixed whatever a run's data settings are, so that one vocabulary size always means one tokenizer."""
    from loopline.data.config import TaskConfig
    from loopline.data.tasks import arithmetic_splits

    train, _ = arithmetic_splits(TaskConfig(), seed=0)
    return [row.prompt + row.completion for row in train]


def train_bpe_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on `bpe_corpus()` (BPE_TRAINED tokens: pad/bos/eos, the 256 bytes and the
    merges), padded to `vocab_size` with `<|unused_N|>` entries that no text encodes to (plain vocabulary
    entries, not added tokens: 150k added tokens would take transformers ~10 s to load). Deterministic."""
    if vocab_size < BPE_TRAINED:
        raise ValueError(
            f"vocab_size ({vocab_size}) is smaller than the trained tokenizer's {BPE_TRAINED} tokens"
        )
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_TRAINED,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    learner.train_from_iterator(bpe_corpus(), trainer)
    learned = json.loads(learner.to_str())["model"]
    vocab: dict[str, int] = dict(learned["vocab"])
    for i in range(vocab_size - len(vocab)):
        vocab[f"<|unused_{i}|>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    return _byte_level(vocab, merges, add_specials=True)


def bpe_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """train_bpe_tokenizer(vocab_size), trained once per machine and size and kept under cache_root(): written
    to a temporary directory and renamed into place, so ranks starting together never read half a tokenizer."""
    where = cache_root() / "tokenizers" / f"bpe-v{BPE_VERSION}-{BPE_TRAINED}-{vocab_size}"
    if (where / "tokenizer.json").is_file():
        return load_tokenizer(where)
    tokenizer = train_bpe_tokenizer(vocab_size)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{where.name}-", dir=where.parent))
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, where)
        except OSError:  # another process put its copy there first: the same tokenizer
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:  # a cache that cannot be written costs a retraining next time, nothing else
        pass
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `path`, as it was saved. AutoTokenizer also reads a config.json beside it and, for
    some model types (qwen2, qwen3), rebuilds that model's own tokenizer class from the vocabulary: another
    pre-tokenizer (digits split one by one) and an added unknown token, so loopline's own tokenizers (the byte
    one, the trained BPE) would encode differently after a save. One saved as the generic class loads as it."""
    path = Path(path)
    config = path / "tokenizer_config.json"
    saved = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if saved in ("TokenizersBackend", "PreTrainedTokenizerFast") and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
