"""The built-in byte tokenizer: every UTF-8 byte is one token, plus pad/bos/eos.

Made with the `tokenizers` library and wrapped as a real PreTrainedTokenizerFast, so
save_pretrained/from_pretrained round-trip and any HF tooling accepts it.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer with no merges (ids 0-2 are pad/bos/eos)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins, one per byte
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for byte_char in sorted(alphabet):
        vocab[byte_char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
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
