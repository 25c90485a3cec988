"""Detokenizer: turns each request's new token ids into a text delta, incrementally.

Only a small window of ids is decoded per step (the prefix/read offsets of the seed design),
so the cost per token stays flat however long the output grows. A delta that ends inside a
multi-byte character waits for the next token. With stop strings, the last len(stop) - 1
characters are held back until it is certain they don't begin a stop string; at the end the
text is cut before the stop string. Joining a stream's deltas gives the final text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rollout.engine.messages import DecodeParams, ReqOutput, failure_reason
from rollout.engine.processes import Addresses
from rollout.engine.token_text import decode_options

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


@dataclass
class DecodeState:
    params: DecodeParams
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # everything decoded so far
    sent: int = 0  # characters of `text` already sent


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def process(self, out: ReqOutput) -> None:
        """Fills `out.text` with the request's new text; forgets the request once finished."""
        state = self.states.get(out.rid)
        if state is None:
            state = self._start(out.decode_params or DecodeParams())
            self.states[out.rid] = state
        reason = out.finish_reason or {}
        new_ids = out.new_ids
        if (
            reason.get("type") == "stop"
            and isinstance(reason.get("matched"), int)
            and not state.params.no_stop_trim
            and new_ids
        ):
            new_ids = new_ids[:-1]  # the stop token itself is not part of the text
        state.ids.extend(new_ids)
        self._decode(state, final=out.finish_reason is not None)
        end = len(state.text)
        if out.finish_reason is not None:
            if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
                if not state.params.no_stop_trim:
                    at = state.text.find(reason["matched"])
                    end = at if at >= 0 else end
            del self.states[out.rid]
        elif state.params.stop:
            # Hold back what may be the start of a stop string, and never pass one.
            end -= max(len(s) for s in state.params.stop) - 1
            for stop in state.params.stop:
                at = state.text.find(stop, state.sent)
                if at >= 0:
                    end = min(end, at)
        end = max(end, state.sent)
        out.text = state.text[state.sent : end]
        state.sent = end

    def process_or_fail(self, out: ReqOutput) -> None:
        """As `process`; if decoding fails, the output instead finishes its request with an error
        (the tokenizer manager then aborts it) and the detokenizer serves on."""
        try:
            self.process(out)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            logger.exception("request %s: decoding its text failed", out.rid)
            self.states.pop(out.rid, None)
            out.text = ""
            out.finish_reason = failure_reason("decoding its text", e)

    def _start(self, params: DecodeParams) -> DecodeState:
        """A request's state, its window opening on the prompt's last tokens: the first output
        tokens' text is what they add after the prompt, as decoding the whole sequence gives
        (a decoder may drop a text's first space). Not when those tokens end inside a
        character, which the output's first bytes would complete."""
        context = list(params.context_ids)
        if context and self.tokenizer.decode(context, **decode_options(params)).endswith(REPLACEMENT):
            context = []
        return DecodeState(params, ids=context, read_offset=len(context))

    def _decode(self, state: DecodeState, final: bool) -> None:
        kw = decode_options(state.params)
        if state.read_offset == len(state.ids):
            return
        before = self.tokenizer.decode(state.ids[state.prefix_offset : state.read_offset], **kw)
        after = self.tokenizer.decode(state.ids[state.prefix_offset :], **kw)
        # A trailing replacement character is an incomplete character: wait for more ids.
        if len(after) > len(before) and (final or not after.endswith(REPLACEMENT)):
            state.text += after[len(before) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.ids)


def run_detokenizer_process(tokenizer_path: str, addrs: Addresses, parent_pid: int) -> None:
    """Process entry: forwards every message from the scheduler to the tokenizer manager,
    filling in text on the way. Exits on the scheduler's shutdown reply or its failure."""
    import pickle

    import zmq
    from transformers import AutoTokenizer

    from rollout.engine.heap import startup_heap_frozen
    from rollout.engine.messages import ControlReply, ReqOutputBatch, SchedulerFailed, is_control
    from rollout.engine.processes import watch_parent

    watch_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format="[detokenizer] %(levelname)s %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(addrs.detokenizer)
    send = ctx.socket(zmq.PUSH)
    send.connect(addrs.tokenizer_manager)
    try:
        detok = Detokenizer(AutoTokenizer.from_pretrained(tokenizer_path))
    except Exception as e:  # noqa: BLE001 - reported to the caller, who raises it
        send.send_pyobj(SchedulerFailed(f"detokenizer failed to start: {e!r}"))
        return
    with startup_heap_frozen():
        while True:
            frames = recv.recv_multipart()
            if is_control(frames):  # a control reply: plain data, passed on as it is
                send.send_multipart(frames)
                if ControlReply.from_frames(frames).last:
                    break
                continue
            msg = pickle.loads(frames[0])
            if isinstance(msg, ReqOutputBatch):
                for out in msg.outputs:
                    detok.process_or_fail(out)
            send.send_pyobj(msg)
            if isinstance(msg, SchedulerFailed):
                break
    send.close(linger=1000)
    recv.close(linger=0)
    ctx.term()
