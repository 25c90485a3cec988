"""Incremental detokenization: deltas join to the full decode, stop strings cut exactly."""

from __future__ import annotations

from transformers import AutoTokenizer

from rollout.engine.detokenizer import Detokenizer
from rollout.engine.messages import DecodeParams, ReqOutput


def _out(rid: str, ids: list[int], finish=None, params=None) -> ReqOutput:
    return ReqOutput(rid, ids, finish, 1, 1, 0, "default", decode_params=params)


def test_one_token_at_a_time_joins_to_the_full_text_with_multibyte_characters(tiny_qwen3):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    text = "héllo wörld — 世界 🎉 done"
    ids = tok.encode(text)
    detok = Detokenizer(tok)
    deltas = []
    for i, t in enumerate(ids):
        finish = {"type": "length"} if i == len(ids) - 1 else None
        out = _out("a", [t], finish, DecodeParams() if i == 0 else None)
        detok.process(out)
        assert "\ufffd" not in out.text  # a partial character is never emitted
        deltas.append(out.text)
    assert "".join(deltas) == text == tok.decode(ids)
    assert detok.states == {}  # forgotten once finished


def test_stop_string_is_held_back_then_cut(tiny_qwen3):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    ids = tok.encode("one two three four")
    detok = Detokenizer(tok)
    params = DecodeParams(stop=("three",))
    sent = ""
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = _out("b", [t], {"type": "stop", "matched": "three"} if last else None, params if i == 0 else None)
        detok.process(out)
        sent += out.text
        assert "thr" not in sent  # the start of the stop string is never streamed
    assert sent == "one two "


def test_matched_stop_token_is_not_in_the_text(tiny_qwen3):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    ids = tok.encode("hello world")
    detok = Detokenizer(tok)
    out = _out("c", ids, {"type": "stop", "matched": ids[-1]}, DecodeParams())
    detok.process(out)
    assert out.text == tok.decode(ids[:-1])
