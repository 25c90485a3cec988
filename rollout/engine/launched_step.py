"""LaunchedStep: a step queued on the device, and the per-request outputs it resolves to.

The model runner launches a step without waiting for the device: sampled tokens, logprobs,
hidden states and embeddings stay device tensors, copied to host memory asynchronously.
`outputs()` is the one place a step waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from rollout.engine.req import ScheduleBatch


@dataclass
class ReqStepOutput:
    """What one request got from one step. Logprob entries are (logprob, token_id)."""

    next_token: int | None = None
    token_logprob: tuple[float, int] | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    token_ids_logprobs: list[tuple[float, int]] | None = None
    hidden_state: list[float] | None = None
    embedding: list[float] | None = None  # embed requests: pooled output of the last token
    # Prompt positions computed this step: (logprob, id), top-k and requested-id logprobs.
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)


class LogitRow(NamedTuple):
    """A hidden-state row of the step that yields an output, and why."""

    req: int  # the request's index in the batch
    kind: str  # "sample" (next token), "prompt" (a prompt token's logprob), "pool" (embedding)
    # sample: the request's sequence length after this step; prompt: the token id scored.
    target: int


@dataclass
class LaunchedStep:
    """A step whose device work is queued. `tensors` (named below) are on their way to host
    memory; `ready` marks when they, and the rest of the step's device work, are done.

    tokens [S]: sampled ids of the "sample" rows, in row order. pooled [P, D]: embeddings of the
    "pool" rows. hidden [H, hidden]: final hidden states of the sample rows that asked for them.
    For the rows whose request returns logprobs, in row order: chosen [L] (logprob of the
    sampled or scored token), top_values / top_ids [L, K] (K = the largest top_logprobs_num),
    id_logprobs [N] (each row's token_ids_logprob, flattened)."""

    batch: ScheduleBatch
    rows: list[LogitRow]
    outs: list[ReqStepOutput]  # one per request; launch fills what needs no device result
    tensors: dict[str, Tensor] = field(default_factory=dict)
    ready: torch.cuda.Event | None = None

    def copy_to_host(self, device: torch.device) -> None:
        """Starts the copies of `tensors` into pinned host memory and records `ready` after them.
        On the host this is a no-op: the tensors are there already."""
        if device.type != "cuda":
            return
        # NOTE: non_blocking copies to the CPU land in pinned memory (torch allocates it so).
        self.tensors = {name: t.to("cpu", non_blocking=True) for name, t in self.tensors.items()}
        self.ready = torch.cuda.Event()
        self.ready.record()

    def wait(self) -> None:
        """Returns once the step's device work and copies are done."""
        if self.ready is not None:
            self.ready.synchronize()

    def outputs(self) -> list[ReqStepOutput]:
        """Waits for the device, then returns one output per request of the batch, in order."""
        self.wait()
        host = {name: t.tolist() for name, t in self.tensors.items()}
        if host.keys() == {"tokens"} and len(host["tokens"]) == len(self.rows):
            # Only sampled tokens, one per row (as in most decodes): no logprobs, hidden
            # states, prompt rows or embeddings to hand out.
            for row, token in zip(self.rows, host["tokens"]):
                self.outs[row.req].next_token = token
            return self.outs
        rows = len(self.rows)
        if host.keys() == {"tokens", "chosen"} and len(host["tokens"]) == len(host["chosen"]) == rows:
            # A sampled token and its logprob per row (an RL trainer's decode): the same with
            # one more field, and no top-k, named ids or prompt rows.
            for row, token, logprob in zip(self.rows, host["tokens"], host["chosen"]):
                out = self.outs[row.req]
                out.next_token, out.token_logprob = token, (logprob, token)
            return self.outs
        tokens, pooled, hidden = (iter(host.get(n, ())) for n in ("tokens", "pooled", "hidden"))
        chosen, id_logprobs = iter(host.get("chosen", ())), iter(host.get("id_logprobs", ()))
        top_values, top_ids = iter(host.get("top_values", ())), iter(host.get("top_ids", ()))
        for row in self.rows:
            req, out = self.batch.reqs[row.req].req, self.outs[row.req]
            if row.kind == "pool":
                out.embedding = next(pooled)
                continue
            token = next(tokens) if row.kind == "sample" else row.target
            if row.kind == "sample":
                out.next_token = token
                if req.return_hidden_states:
                    out.hidden_state = next(hidden)
            if not req.return_logprob:
                continue
            entry = (next(chosen), token)
            k = req.top_logprobs_num
            values, ids = (next(top_values), next(top_ids)) if "top_values" in host else ((), ())
            top = list(zip(values[:k], ids[:k])) if k > 0 else None
            wanted = req.token_ids_logprob
            given = [(next(id_logprobs), t) for t in wanted] if wanted else None
            if row.kind == "sample":
                out.token_logprob, out.top_logprobs, out.token_ids_logprobs = entry, top, given
            else:
                out.input_token_logprobs.append(entry)
                out.input_top_logprobs.append(top)
                out.input_token_ids_logprobs.append(given)
        return self.outs
