"""Tokenizers built here, of the kinds the tiny models' byte-level BPE is not."""

from __future__ import annotations

WORDS = ("▁Hello", "▁world", "▁is", "▁the")


def llama2_style_tokenizer():
    """A sentencepiece-style tokenizer as Llama 2's and Mistral's: words spelled "▁word", a
    space put before the text when encoding and dropped again when decoding (so "▁is" decodes
    alone to "is" but adds " is" after text), unknown characters in byte tokens "<0xNN>"."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in "▁abcdefghijklmnopqrstuvwxyzH":
        vocab[piece] = len(vocab)
    merges = []
    for word in WORDS:
        for end in range(2, len(word) + 1):
            merges.append((word[: end - 1], word[end - 1]))
            vocab.setdefault(word[:end], len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
