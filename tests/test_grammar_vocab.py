"""The vocabulary a grammar sees is each token's bytes as an output's text gets them: a token that
decodes to a control byte is one whatever its vocabulary entry looks like, and a special token
that outputs skip adds nothing. (xgrammar's own reading of a Hugging Face tokenizer guesses the
encoding: a byte-level vocabulary that also holds "<0x07>"-style pieces passed for byte-fallback,
its "ć" for the letter ć rather than the byte 0x07, and JSON outputs held raw control
characters.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from rollout import RolloutEngine
from rollout.engine.grammar_backend import GrammarBackend
from rollout.engine.grammar_mask import mask_logits
from rollout.engine.grammar_spec import GrammarSpec
from rollout.tiny_model import make_tiny_model, write_tokenizer

pytest.importorskip("xgrammar")

BYTE_PIECES = [f"<0x{byte:02X}>" for byte in range(256)]  # plain text here, not bytes


def _tokenizer(path: str, byte_pieces: bool) -> Any:
    """The tokenizer saved at `path`, plus BYTE_PIECES when asked."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    if byte_pieces:
        tokenizer.add_tokens(BYTE_PIECES)
    return tokenizer


@pytest.fixture(scope="module")
def byte_pieces_model(tmp_path_factory) -> str:
    """A tiny qwen2 whose byte-level tokenizer (and vocabulary) also holds BYTE_PIECES."""
    path = str(tmp_path_factory.mktemp("byte-pieces"))
    write_tokenizer(path)
    tokenizer = _tokenizer(path, byte_pieces=True)
    make_tiny_model(path, "qwen2", seed=1, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)  # over the plain one make_tiny_model wrote
    return path


def _allowed(backend: GrammarBackend, spec: GrammarSpec, output_ids: list[int]) -> set[int]:
    """The ids the grammar allows after `output_ids`."""
    grammar = backend.matcher(spec)
    grammar.advance(output_ids)
    logits = torch.zeros(1, backend.vocab_size)
    mask_logits(logits, [0], [grammar])
    return {i for i in range(backend.vocab_size) if logits[0, i] == 0}


@pytest.mark.parametrize("byte_pieces", [False, True], ids=["tiny", "tiny-with-byte-pieces"])
def test_a_json_string_never_allows_a_control_character(tmp_path, byte_pieces):
    write_tokenizer(str(tmp_path))
    tokenizer = _tokenizer(str(tmp_path), byte_pieces)
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    quote = tokenizer.encode('"', add_special_tokens=False)
    allowed = _allowed(backend, GrammarSpec("json_schema", '{"type": "string"}'), quote)
    texts = {i: tokenizer.decode([i]) for i in allowed}
    assert not {i: t for i, t in texts.items() if any(ord(c) < 0x20 for c in t)}
    assert "a" in texts.values() and "\\" in texts.values()
    if byte_pieces:  # the pieces are text that a string may hold
        assert tokenizer.convert_tokens_to_ids("<0x07>") in allowed
    backend.close()


def test_the_grammar_sees_each_token_as_an_output_decodes_it(tiny_qwen2, tmp_path):
    write_tokenizer(str(tmp_path))
    # Qwen2Tokenizer (rebuilt by transformers for qwen2 checkpoints) and the saved tokenizer.
    for tokenizer in (_tokenizer(tiny_qwen2, False), _tokenizer(str(tmp_path), True)):
        V = len(tokenizer) + 30  # the ids past the tokenizer add nothing
        backend = GrammarBackend(tokenizer, V, [tokenizer.eos_token_id])
        vocab = backend.compile(GrammarSpec("regex", "a")).tokenizer_info.decoded_vocab
        assert len(vocab) == V and vocab[len(tokenizer) :] == [b""] * 30
        for i, raw in enumerate(vocab[: len(tokenizer)]):
            # As outputs decode by default: special tokens skipped.
            text = tokenizer.decode([i], skip_special_tokens=True)
            if "\ufffd" in text:  # only part of a character: its own bytes
                assert raw and raw.decode("utf-8", "replace") == text, i
            else:
                assert raw == text.encode(), (i, raw, text)
        backend.close()


def test_json_outputs_hold_no_raw_control_characters(byte_pieces_model):
    params = {"temperature": 1.0, "max_new_tokens": 32, "n": 32, "seed": 3,
              "json_schema": {"type": "object"}}  # fmt: skip
    with RolloutEngine(
        byte_pieces_model, dtype="float32", device="cpu", max_total_tokens=4096
    ) as engine:
        outs = engine.generate(prompt="Hello there", sampling_params=params)
    ended = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert ended
    for out in outs:  # ("<0x7B>" passed for "{" too)
        assert out["text"].startswith("{"), out["text"]
        assert not any(ord(c) < 0x20 for c in out["text"]), out["text"]
    for out in ended:
        assert isinstance(json.loads(out["text"]), dict)
