"""Incremental detokenization: deltas join to the full decode, stop strings cut exactly."""

from __future__ import annotations

from transformers import AutoTokenizer

from rollout.engine.detokenizer import Detokenizer
from rollout.engine.messages import DecodeParams, ReqOutput, TokenizedRequest
from rollout.engine.req import Req
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.stop_checker import StopChecker


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


class _SpacedSpecials:
    """A vocabulary whose decoder puts a space between two special tokens unless told not to
    (transformers' slow tokenizers did): ids 1-26 are letters, 100 and 101 "<a>" and "<b>"."""

    special = {100: "<a>", 101: "<b>"}

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True, **kw):
        parts = [self.special.get(i, chr(96 + i)) for i in ids
                 if not (skip_special_tokens and i in self.special)]  # fmt: skip
        text = parts[0] if parts else ""
        for before, part in zip(parts, parts[1:]):
            both = before in self.special.values() and part in self.special.values()
            text += (" " if both and spaces_between_special_tokens else "") + part
        return text


def test_stop_strings_match_the_text_the_request_s_decode_options_give():
    tok = _SpacedSpecials()
    for spaced, stop, other in ((True, "<a> <b>", "<a><b>"), (False, "<a><b>", "<a> <b>")):
        kw = {"skip_special_tokens": False, "spaces_between_special_tokens": spaced}
        params = SamplingParams(stop=[stop, "zz"], **kw)
        req = Req(TokenizedRequest("r", [1, 2], params, seed=0), max_new_tokens=8)
        checker = StopChecker(tok, eos_token_ids=[])
        req.output_ids = [3, 100]
        assert checker.check(req) is None
        req.output_ids.append(101)
        assert checker.check(req) == {"type": "stop", "matched": stop}
        # The detokenizer reads the same text: the stop string it cuts is the one matched.
        detok = Detokenizer(tok)
        decode = DecodeParams(stop=(stop,), context_ids=(1, 2), **kw)
        out = _out("r", req.output_ids, {"type": "stop", "matched": stop}, decode)
        detok.process(out)
        assert out.text == "c"
        unmatched = SamplingParams(stop=[other], **kw)
        req = Req(TokenizedRequest("s", [1, 2], unmatched, seed=0), max_new_tokens=8)
        req.output_ids = [3, 100, 101]
        assert checker.check(req) is None
