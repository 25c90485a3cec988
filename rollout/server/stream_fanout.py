"""Streaming /generate for a batch of prompts or n > 1: one engine stream per sample, merged.

As SGLang does it, every event is one sample's output so far with an `index`: its place in the
non-streamed answer's list (prompt-major, n samples per prompt). Each sample is the request
that the engine would run for it unstreamed: the same prompt, seed (seed + j for sample j) and
rid ("rid-j" with n > 1).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from rollout.generate_request import GenerateRequest
from rollout.server.streaming import gather_streams


def is_fanout(call: GenerateRequest) -> bool:
    """Whether a streamed call names several samples (or came as a list), so its events need an
    index. Read from the call's shape alone: nothing is tokenized here."""
    if isinstance(call.prompt, list) or isinstance(call.sampling_params, list):
        return True
    ids = call.input_ids
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return True
    params = call.sampling_params
    return isinstance(params, dict) and params.get("n", 1) not in (1, None)


def split(call: GenerateRequest) -> list[GenerateRequest]:
    """The call's single-sample requests in answer order. Call after validate_generate: the
    shapes are known good."""
    if call.prompt is not None:
        prompts: list[Any] = call.prompt if isinstance(call.prompt, list) else [call.prompt]
        key = "prompt"
    else:
        ids = call.input_ids
        prompts = ids if ids and isinstance(ids[0], list) else [ids]  # type: ignore[index]
        key = "input_ids"
    params = call.sampling_params
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    rids = call.rid if isinstance(call.rid, list) else [call.rid] * len(prompts)
    samples = []
    for prompt, p, rid in zip(prompts, per_prompt, rids):
        p = dict(p or {})
        n = p.pop("n", 1) or 1
        seed = p.pop("seed", None)
        seed = p.pop("sampling_seed", None) if seed is None else seed
        for j in range(n):
            one = {**p, "n": 1}
            if seed is not None:
                one["seed"] = seed + j
            samples.append(
                replace(
                    call,
                    **{key: prompt},
                    sampling_params=one,
                    rid=rid if rid is None or n == 1 else f"{rid}-{j}",
                    stream=True,
                )
            )
    return samples


async def open_fanout(engine: Any, call: GenerateRequest) -> AsyncIterator[dict]:
    """Checks the call as one request (sizes and limits over all samples together), starts a
    stream per sample and waits for each one's first output, so a request that fails does so
    before the 200. Returns the merged stream, each item with its `index`."""
    await engine.run_in_worker(engine.validate_generate, call)
    streams = [await engine.async_generate(sample) for sample in split(call)]
    return gather_streams(await first_outputs(streams), lambda i, out: [{**out, "index": i}])


async def first_outputs(streams: list[AsyncIterator[dict]]) -> list[AsyncIterator[dict]]:
    """Waits for every stream's first output; if any failed, closes them all and raises the
    first failure. Returns the streams, each from its first output on."""
    waits = [asyncio.ensure_future(s.__anext__()) for s in streams]
    try:
        firsts = await asyncio.gather(*waits, return_exceptions=True)
        failed = [f for f in firsts if isinstance(f, BaseException)]
        if failed:
            raise failed[0]
    except BaseException:  # a stream failed, or the client left first: all of them end (abort)
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        for s in streams:
            await s.aclose()
        raise
    return [_chain(first, s) for first, s in zip(firsts, streams)]


async def _chain(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
