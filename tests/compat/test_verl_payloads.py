"""verl's generation and control calls, as its code sends them (volcengine/verl:
verl/workers/rollout/sglang_rollout/http_server_engine.py, async_sglang_server.py,
sglang_rollout.py), over HTTP and through the Engine API, answered in SGLang's shapes.

- launch_server_process: GET /health_generate, then GET /flush_cache until 200 (its JSON is
  read), with `Authorization: Bearer None` when the server has no key;
- HttpServerAdapter.generate: POST /generate with `text` or `input_ids`, `sampling_params`,
  `return_logprob`, ... and every None field left out; sampling params as sglang_rollout builds
  them (n, max_new_tokens, penalties, temperature, top_p, top_k, ignore_eos,
  skip_special_tokens, spaces_between_special_tokens);
- abort_request: POST {"rid": "", "abort_all": false|true};
- sleep / wake_up: POST /release_memory_occupation and /resume_memory_occupation
  {"tags": ["kv_cache", "weights"]} (or null), then flush; GET /v1/models;
- the async server's token-in-token-out path: GenerateReqInput(rid, input_ids, sampling_params,
  return_logprob, image_data=None), read as (logprob, token id, _) triples.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from sglang_shapes import NO_KEY_HEADERS, assert_generate_shape, engine_generate

PROMPT_IDS = [31, 7, 402, 99, 12, 250]


def verl_sampling_params(**overrides) -> dict:
    params = dict(
        n=1,
        max_new_tokens=16,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        ignore_eos=False,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
    )
    return {**params, **overrides}


def adapter_payload(prompt=None, input_ids=None, sampling_params=None, return_logprob=False,
                    logprob_start_len=None, top_logprobs_num=None) -> dict:  # fmt: skip
    """HttpServerAdapter.generate's body: None fields filtered out."""
    payload = {
        "text": prompt,
        "sampling_params": sampling_params,
        "input_ids": input_ids,
        "image_data": None,
        "return_logprob": return_logprob,
        "logprob_start_len": logprob_start_len,
        "top_logprobs_num": top_logprobs_num,
        "token_ids_logprob": None,
        "lora_path": None,
        "custom_logit_processor": None,
    }
    return {k: v for k, v in payload.items() if v is not None}


def test_launch_health_and_cache_flush(server):
    with httpx.Client(base_url=server, headers=NO_KEY_HEADERS, timeout=60) as http:
        assert http.get("/health_generate").status_code == 200
        flushed = http.get("/flush_cache")
        assert flushed.status_code == 200 and isinstance(flushed.json(), dict)
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and len(models["data"]) == 1


@pytest.mark.parametrize(
    "payload",
    [
        adapter_payload(prompt="The capital of France is", sampling_params=verl_sampling_params()),
        adapter_payload(
            input_ids=PROMPT_IDS,
            sampling_params=verl_sampling_params(temperature=0, top_k=1),
            return_logprob=True,
        ),
        adapter_payload(
            input_ids=PROMPT_IDS,
            sampling_params=verl_sampling_params(max_new_tokens=4),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
        ),
    ],
)
def test_adapter_generate_over_http_and_the_engine(server, engine, payload):
    out = httpx.post(f"{server}/generate", json=payload, timeout=60).json()
    assert_generate_shape(out, logprobs=payload.get("return_logprob", False))
    local = engine_generate(engine, payload)
    assert_generate_shape(local, logprobs=payload.get("return_logprob", False))
    if payload["sampling_params"]["temperature"] == 0:
        assert local["output_ids"] == out["output_ids"]
    if payload.get("logprob_start_len") == 0:
        meta = out["meta_info"]
        assert len(meta["input_token_logprobs"]) == len(PROMPT_IDS)
        assert meta["input_token_logprobs"][0][0] is None
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_abort_request_bodies(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        for body in ({"rid": "", "abort_all": False}, {"rid": "", "abort_all": True}):
            r = http.post("/abort_request", json=body)
            assert r.status_code == 200 and r.json()["success"], r.text


def test_sleep_and_wake_up(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        for tags in (["kv_cache", "weights"], None):
            r = http.post("/release_memory_occupation", json={"tags": tags})
            assert r.status_code == 200 and r.json()["success"], r.text
            r = http.post("/resume_memory_occupation", json={"tags": tags})
            assert r.status_code == 200 and r.json()["success"], r.text
            assert http.get("/flush_cache").status_code == 200
        body = adapter_payload(input_ids=PROMPT_IDS, sampling_params=verl_sampling_params())
        assert_generate_shape(http.post("/generate", json=body).json(), logprobs=False)


def test_async_server_token_in_token_out(engine):
    """SGLangHttpServer.generate: one GenerateReqInput per request id, its first output read."""

    async def generate(request_id: str, sampling_params: dict) -> tuple[list[int], list[float]]:
        return_logprob = sampling_params.pop("logprobs", False)
        output = await engine.async_generate(
            rid=request_id,
            input_ids=PROMPT_IDS,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            image_data=None,
        )
        entries = output["meta_info"]["output_token_logprobs"]
        log_probs, token_ids = zip(*[(lp, tid) for lp, tid, _ in entries], strict=True)
        assert list(token_ids) == output["output_ids"]
        return list(token_ids), list(log_probs)

    async def run() -> list:
        params = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0,
                  "max_new_tokens": 8, "logprobs": True}  # fmt: skip
        return await asyncio.gather(
            *(generate(uuid.uuid4().hex, dict(params)) for _ in range(3))
        )

    for token_ids, log_probs in asyncio.run(run()):
        assert 0 < len(token_ids) == len(log_probs) <= 8
    engine.release_memory_occupation(tags=["kv_cache", "weights"])
    engine.resume_memory_occupation(tags=["kv_cache", "weights"])
    assert engine.flush_cache()["success"]
