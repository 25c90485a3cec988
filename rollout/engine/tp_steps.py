"""Tensor parallelism inside one engine: rank 0 decides each step, every rank runs it.

Only rank 0 runs a Scheduler (admission, KV allocation, the prefix cache, stops, versions):
the schedule is decided once, so the ranks can never disagree on it. Before rank 0's model
runner launches a batch, `StepSender` sends every other rank a `Step`: the batch's shape, the
KV slots its new tokens go to, the req->token table writes made since the last step, and of
each request what the ranks must know to build the same forward (its ids, row, KV length).
A rank keeps one `Req` per table row (`StepReceiver`), so a request's prompt crosses once and
each step carries only its new output ids. Every rank then runs the same forward, whose
collectives (all-reduce, all-gather) line up across the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import zmq

from rollout.engine.messages import TokenizedRequest
from rollout.engine.req import Req, ScheduleBatch
from rollout.forward.forward_batch import ForwardMode
from rollout.forward.kv_pool import ReqToTokenPool, TableWrite


@dataclass
class StepReq:
    """One request of a Step, as the other ranks need it."""

    rid: str
    row: int
    kv_len: int  # as planned: the position of the step's first token of it
    request: TokenizedRequest | None  # when the rank doesn't know this request at this row yet
    keep: int  # how many of the output ids the rank already has it keeps
    new_output_ids: list[int]
    input_logprobs_done: bool


@dataclass
class Step:
    mode: ForwardMode
    reqs: list[StepReq]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # [sum(extend_lens)] int64, host
    table_writes: list[TableWrite] = field(default_factory=list)


class StepSender:
    """Rank 0's side: sends each batch to the other ranks before rank 0 launches it."""

    def __init__(self, sockets: list[zmq.Socket], table: ReqToTokenPool) -> None:
        self.sockets = sockets
        self.table = table
        table.journal = []  # every write from now on is sent with the next step
        self.known: dict[int, tuple[str, int]] = {}  # row -> (rid, output ids the ranks have)

    def send(self, batch: ScheduleBatch) -> None:
        step = Step(
            batch.mode,
            [self._describe(req, start) for req, start in zip(batch.reqs, batch.starts)],
            list(batch.extend_lens),
            batch.out_cache_loc,
            self.table.take_journal(),
        )
        for sock in self.sockets:
            sock.send_pyobj(step)

    def send_message(self, message: object) -> None:
        """Anything else the ranks run in order with the steps (control traffic)."""
        for sock in self.sockets:
            sock.send_pyobj(message)

    def _describe(self, req: Req, start: int) -> StepReq:
        assert req.row is not None, "a request in a batch has a req->token row"
        rid, known = self.known.get(req.row, (None, 0))
        out = req.output_ids
        new = rid != req.rid or known > len(out)
        keep = 0 if new else known
        self.known[req.row] = (req.rid, len(out))
        return StepReq(
            req.rid, req.row, start, req.req if rid != req.rid else None, keep,
            out[keep:], req.input_logprobs_done,
        )  # fmt: skip


class StepReceiver:
    """Another rank's side: turns each Step back into the ScheduleBatch rank 0 launched."""

    def __init__(self, table: ReqToTokenPool) -> None:
        self.table = table
        self.reqs: dict[int, Req] = {}  # row -> the request rank 0 last sent at that row

    def batch(self, step: Step) -> ScheduleBatch:
        self.table.replay(step.table_writes)
        reqs = []
        for s in step.reqs:
            req = self.reqs.get(s.row)
            if s.request is not None or req is None or req.rid != s.rid:
                if s.request is None:
                    raise RuntimeError(f"rank 0 sent request {s.rid} without its ids")
                req = self.reqs[s.row] = Req(req=s.request, max_new_tokens=0)
            req.row, req.kv_len = s.row, s.kv_len
            del req.output_ids[s.keep :]
            req.output_ids.extend(s.new_output_ids)
            req.input_logprobs_done = s.input_logprobs_done
            reqs.append(req)
        return ScheduleBatch(step.mode, reqs, step.extend_lens, step.out_cache_loc)
