"""Text of a sentencepiece vocabulary whose decoder drops a text's first space (Llama 2's,
Mistral's): "▁is" decodes alone to "is" but adds " is" after text. An output's text is what it
adds after its prompt, as decoding the whole sequence gives, and each logprob token's text and
bytes are what it adds there: joined, they are the output's text."""

from __future__ import annotations

import shutil

import pytest
from tokenizer_helpers import llama2_style_tokenizer

from rollout import RolloutEngine
from rollout.engine.detokenizer import Detokenizer
from rollout.engine.messages import DecodeParams, ReqOutput
from rollout.engine.req import DECODE_CONTEXT_TOKENS
from rollout.engine.token_text import TokenText
from rollout.server.openai_format import chat_logprobs, completion_logprobs, prompt_logprobs


@pytest.fixture(scope="module")
def tok():
    return llama2_style_tokenizer()


def _after(tok, prompt: list[int], output: list[int]) -> str:
    """What `output` adds to the text of `prompt`, by decoding both whole."""
    return tok.decode(prompt + output)[len(tok.decode(prompt)) :]


def _stream(tok, prompt: list[int], output: list[int]) -> list[str]:
    detok = Detokenizer(tok)
    params = DecodeParams(context_ids=tuple(prompt[-DECODE_CONTEXT_TOKENS:]))
    deltas = []
    for i, token in enumerate(output):
        finish = {"type": "length"} if i == len(output) - 1 else None
        out = ReqOutput(
            "r", [token], finish, 1, 1, 0, "v", decode_params=params if i == 0 else None
        )
        detok.process(out)
        deltas.append(out.text)
    assert detok.states == {}
    return deltas


def test_an_output_s_text_is_what_it_adds_after_its_prompt(tok):
    prompt = tok.encode("Hello world", add_special_tokens=False)
    output = tok.encode("is the wörld 世 is", add_special_tokens=False)
    expected = _after(tok, prompt, output)
    assert expected.startswith(" is the w")  # decoded alone, the output would begin "is"
    deltas = _stream(tok, prompt, output)
    assert "".join(deltas) == expected and deltas[0] == " is"
    # A prompt ending inside a character: the output completes it, and is decoded alone.
    cut = tok.encode("Hello 世", add_special_tokens=False)
    assert "".join(_stream(tok, cut[:-1], cut[-1:] + output)) == tok.decode(cut[-1:] + output)


def test_logprob_tokens_are_what_they_add_in_the_text(tok):
    text_of = TokenText(tok)
    word, letter = tok.convert_tokens_to_ids(["▁is", "r"])
    assert text_of(word) == " is" and text_of.at_start(word) == "is"
    assert text_of(letter) == "r"
    prompt = tok.encode("Hello world", add_special_tokens=False)
    output = tok.encode("is the wörld 世", add_special_tokens=False)
    content = "".join(_stream(tok, prompt, output))
    meta = {
        "output_token_logprobs": [(-0.5, t, None) for t in output],
        "input_token_logprobs": [(None if i == 0 else -0.5, t, None) for i, t in enumerate(prompt)],
    }
    chat = chat_logprobs(meta, text_of, 0)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat) == content.encode()
    # Echo: the prompt's text, then the completion's; each token begins at its offset.
    echo = prompt_logprobs(meta, text_of)
    completion, end = completion_logprobs(meta, text_of, 0, len(tok.decode(prompt)))
    whole = tok.decode(prompt) + content
    tokens = echo["tokens"] + completion["tokens"]
    offsets = echo["text_offset"] + completion["text_offset"]
    assert tokens[:2] == ["Hello", " world"] and end == len(whole)
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:
            assert whole[offset:].startswith(token), (token, offset)


@pytest.fixture(scope="module")
def engine(tiny_qwen3, tok, tmp_path_factory):
    """The tiny model with the sentencepiece tokenizer in place of its own (a smaller vocabulary)."""
    path = tmp_path_factory.mktemp("llama2-style")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(f"{tiny_qwen3}/{name}", path / name)
    tok.save_pretrained(path)
    with RolloutEngine(str(path), device="cpu") as engine:
        yield engine


def test_the_engine_s_text_and_logprob_tokens_follow_the_prompt(engine, tok):
    word = tok.convert_tokens_to_ids("▁is")
    prompt = tok.encode("Hello world", add_special_tokens=False)
    out = engine.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 6, "ignore_eos": True, "logit_bias": {word: 100}},
        return_logprob=True,
        return_text_in_logprobs=True,
    )
    assert out["output_ids"] == [word] * 6
    assert out["text"] == _after(tok, prompt, out["output_ids"]) == " is" * 6
    texts = [text for _, _, text in out["meta_info"]["output_token_logprobs"]]
    assert "".join(texts) == out["text"]


def test_a_stop_string_at_the_output_s_start_stops_it_there(engine, tok):
    word = tok.convert_tokens_to_ids("▁is")
    prompt = tok.encode("Hello world", add_special_tokens=False)
    out = engine.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 6, "logit_bias": {word: 100}, "stop": [" is is"]},
    )
    assert out["output_ids"] == [word] * 2  # the text " is is" holds the stop string
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " is is"}
    assert out["text"] == ""


def test_a_vocabulary_that_spells_no_anchor_decodes_each_token_alone():
    """As the empty tokenizer transformers makes for a checkpoint without tokenizer files,
    which an engine fed token ids serves with."""

    class Spells:
        def __init__(self, known: str) -> None:
            self.known = known

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(text)] if text in self.known else []

        def decode(self, ids: list[int], **kwargs) -> str:
            return "".join(f"<{i}>" if i > 200 else chr(i) for i in ids)

    assert TokenText(Spells(""))(300) == "<300>"
    assert TokenText(Spells("0")).anchor == [ord("0")]
