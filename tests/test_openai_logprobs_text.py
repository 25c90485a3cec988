"""OpenAI logprobs of text with multi-byte characters, split over tokens that each hold part of
one: chat `bytes` join to the content's UTF-8, and legacy completions' `text_offset` are the
character offsets at which the tokens begin in the returned text (the echoed prompt's included),
whole and streamed."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import start_server, stop_server

from rollout.engine.detokenizer import Detokenizer
from rollout.engine.messages import ReqOutput
from rollout.engine.token_text import TokenText
from rollout.server.openai_format import (
    chat_logprobs,
    completion_logprobs,
    join_logprobs,
    prompt_logprobs,
)
from rollout.tiny_model import write_tokenizer

TEXT = "héllo 世界 🙂"
MORE = " 世é!"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """The tiny models' byte-level BPE: its corpus is ASCII, so every other character is split
    into one token per byte."""
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("byte-level"))
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def byte_fallback():
    """A sentencepiece-style tokenizer (Llama 2's decoder) that spells unknown characters in
    byte tokens "<0xNN>"."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "h": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(params=["byte_level", "byte_fallback"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


def _entries(ids: list[int], first: float | None = -0.5) -> list[tuple]:
    return [(first if i == 0 else -0.5, t, None) for i, t in enumerate(ids)]


def _meta(tokenizer, text: str) -> dict:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    tops = [[(-0.5, t, None), (-1.0, ids[0], None)] for t in ids]
    return {"output_token_logprobs": _entries(ids), "output_top_logprobs": tops}


def _check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each token begins at its offset (a token holding part of a character: where that
    character begins), and the offsets never go back."""
    assert offsets == sorted(offsets)
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:
            assert text[offset:].startswith(token), (text, token, offset)
        else:
            assert offset < len(text) and ord(text[offset]) > 0x7F, (text, token, offset)


def test_chat_bytes_are_each_tokens_own_and_join_to_the_content(tokenizer):
    text_of = TokenText(tokenizer)
    meta = _meta(tokenizer, TEXT)
    content = chat_logprobs(meta, text_of, 0)["content"]
    assert any(e["token"] == "\ufffd" for e in content)  # some tokens hold part of a character
    assert b"".join(bytes(e["bytes"]) for e in content) == TEXT.encode()
    for entry in content:
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
        assert entry["top_logprobs"][1]["bytes"] == content[0]["bytes"]
    # Streamed: each chunk's logprobs start where the one before stopped.
    cuts = [0, 2, 3, 7, len(content)]
    chunks = [chat_logprobs(meta, text_of, a)["content"][: b - a] for a, b in zip(cuts, cuts[1:])]
    assert [e for chunk in chunks for e in chunk] == content


def test_completion_offsets_count_a_split_character_once(tokenizer):
    lp, end = completion_logprobs(_meta(tokenizer, TEXT), TokenText(tokenizer), 0, 0)
    _check_offsets(TEXT, lp["tokens"], lp["text_offset"])
    assert lp["text_offset"][-1] == len(TEXT) - 1  # the emoji's last byte: where the emoji begins
    assert end == len(TEXT)  # where the next token would begin


def test_echo_offsets_run_over_the_prompt_then_the_completion(tokenizer):
    text_of = TokenText(tokenizer)
    prompt_ids = tokenizer.encode(TEXT)
    meta = {**_meta(tokenizer, MORE), "input_token_logprobs": _entries(prompt_ids, None)}
    echo = tokenizer.decode(prompt_ids)
    lp = join_logprobs(
        prompt_logprobs(meta, text_of), completion_logprobs(meta, text_of, 0, len(echo))[0]
    )
    _check_offsets(echo + MORE, lp["tokens"], lp["text_offset"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(prompt_ids)] == len(echo)


def test_offsets_are_where_the_text_shown_before_each_token_ends(tokenizer):
    """A token begins where the text of the tokens before it ends, as a stream shows it: whole
    characters only (the detokenizer holds back a character's first bytes). A stream's chunk
    starting there gives the whole response's offsets."""
    text_of = TokenText(tokenizer)
    meta = _meta(tokenizer, TEXT)
    whole = completion_logprobs(meta, text_of, 0, 0)[0]["text_offset"]
    detokenizer, shown = Detokenizer(tokenizer), [0]
    for _, tid, _ in meta["output_token_logprobs"][:-1]:
        out = ReqOutput("r", [tid], None, 0, 0, 0, "v")
        detokenizer.process(out)
        shown.append(shown[-1] + len(out.text))
    assert whole == shown
    for cut in range(1, len(whole)):
        streamed = completion_logprobs(meta, text_of, cut, shown[cut])[0]["text_offset"]
        assert whole[:cut] + streamed == whole, cut


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    proc, url = start_server(tiny_qwen3, "--served-model-name", "tiny")
    yield url
    stop_server(proc)


def test_server_logprobs_of_multibyte_text(server):
    """Chat output held to TEXT by a regex: its tokens' bytes are its UTF-8. Completions echoing
    a prompt of TEXT: the offsets run over the prompt's characters, then the completion's."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "regex": TEXT,
            "logprobs": True, "top_logprobs": 1, "temperature": 0, "max_tokens": 40}  # fmt: skip
    r = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).json()
    [choice] = r["choices"]
    assert choice["message"]["content"] == TEXT
    got = b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
    assert got.removesuffix(b"<|im_end|>") == TEXT.encode()

    body = {"model": "tiny", "prompt": TEXT, "max_tokens": 4, "temperature": 0, "echo": True,
            "logprobs": 1}  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    [choice] = r["choices"]
    lp, prompt_len = choice["logprobs"], r["usage"]["prompt_tokens"]
    assert choice["text"].startswith(TEXT) and lp["text_offset"][prompt_len] == len(TEXT)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    _check_offsets(choice["text"], lp["tokens"][:prompt_len], lp["text_offset"][:prompt_len])
    streamed = httpx.post(f"{server}/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(x[6:]) for x in streamed.text.split("\n\n") if x.startswith("data: {")]
    offsets = [
        o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])
    ]
    assert offsets[:prompt_len] == lp["text_offset"][:prompt_len]


def _streamed_offsets(url: str, body: dict) -> list[int]:
    streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(x[6:]) for x in streamed.text.split("\n\n") if x.startswith("data: {")]
    return [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]


def test_a_stream_held_back_by_a_stop_string_has_the_whole_answers_offsets(server):
    """A stop string holds the text back while its first characters may be matching; the
    tokens' logprobs go out meanwhile, and the next chunk's offsets go on from theirs."""
    body = {"model": "tiny", "prompt": "count", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "stop": ["zzzzzz"]}  # fmt: skip
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    whole = r["choices"][0]["logprobs"]["text_offset"]
    assert len(whole) == 40 and whole == sorted(whole)
    assert _streamed_offsets(server, body) == whole
