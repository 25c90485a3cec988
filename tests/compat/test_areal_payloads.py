"""AReaL's generation and control calls, as its code sends them (inclusionAI/AReaL:
areal/engine/sglang_remote.py RemoteSGLangEngine), over HTTP and through the Engine API,
answered in SGLang's shapes.

- readiness: GET /health until 200;
- agenerate: POST /generate {"input_ids", "image_data": null, "sampling_params": {top_p, top_k,
  max_new_tokens, temperature (0 when greedy), stop_token_ids, frequency_penalty[, stop]},
  "return_logprob": true, "stream": false};
- rollout interruption: around a weight update it POSTs /pause_generation and later
  /continue_generation with no body; a request cut off by the pause comes back with
  finish_reason abort and the tokens so far, and agenerate loops: input_ids += output tokens,
  max_new_tokens -= their count, until stop or length.
"""

from __future__ import annotations

import time

import httpx
import pytest
from sglang_shapes import assert_generate_shape, engine_generate, run_in_thread, wait_generating

PROMPT_IDS = [21, 530, 8, 77, 164, 3, 812]


def areal_payload(input_ids: list[int], max_new_tokens: int, greedy: bool, **gconfig) -> dict:
    sample_params = {
        "top_p": gconfig.get("top_p", 1.0),
        "top_k": gconfig.get("top_k", 100_000_000),
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if greedy else gconfig.get("temperature", 1.0),
        "stop_token_ids": gconfig.get("stop_token_ids", []),
        "frequency_penalty": gconfig.get("frequency_penalty", 0.0),
    }
    if gconfig.get("stop"):
        sample_params["stop"] = gconfig["stop"]
    return {
        "input_ids": list(input_ids),
        "image_data": None,
        "sampling_params": sample_params,
        "return_logprob": True,
        "stream": False,
    }


def agenerate(http: httpx.Client, input_ids: list[int], max_new_tokens: int) -> dict:
    """RemoteSGLangEngine.agenerate's loop (greedy): resend what an interruption cut off."""
    payload = areal_payload(input_ids, max_new_tokens, greedy=True)
    tokens: list[int] = []
    logprobs: list[float] = []
    interrupted, stop_reason = 0, None
    while stop_reason not in ("stop", "tool_calls", "length") and len(tokens) < max_new_tokens:
        result = http.post("/generate", json=payload).json()
        assert_generate_shape(result, logprobs=True)
        meta = result["meta_info"]
        stop_reason = meta["finish_reason"]["type"]
        interrupted += stop_reason == "abort"
        out = [x[1] for x in meta["output_token_logprobs"]]
        tokens += out
        logprobs += [x[0] for x in meta["output_token_logprobs"]]
        payload["input_ids"] += out
        payload["sampling_params"]["max_new_tokens"] -= len(out)
    return {"tokens": tokens, "logprobs": logprobs, "interrupted": interrupted,
            "stop_reason": stop_reason}  # fmt: skip


def test_health_and_generate_payload_over_http_and_the_engine(server, engine):
    assert httpx.get(f"{server}/health").status_code == 200
    for greedy, extra in ((True, {}), (False, {"stop_token_ids": [2], "stop": ["\n\n"],
                                              "frequency_penalty": 0.1})):  # fmt: skip
        payload = areal_payload(PROMPT_IDS, 12, greedy, **extra)
        out = httpx.post(f"{server}/generate", json=payload, timeout=60).json()
        assert_generate_shape(out, logprobs=True)
        assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        local = engine_generate(engine, payload)
        assert_generate_shape(local, logprobs=True)
        if greedy:
            assert local["output_ids"] == out["output_ids"]


def test_a_pause_interrupts_agenerate_which_resumes_to_the_same_tokens(server):
    budget = 400
    with httpx.Client(base_url=server, timeout=120) as http:
        reference = agenerate(http, PROMPT_IDS, budget)
        assert reference["interrupted"] == 0 and len(reference["tokens"]) <= budget
        thread, box = run_in_thread(lambda: agenerate(httpx.Client(base_url=server, timeout=120),
                                                      PROMPT_IDS, budget))  # fmt: skip
        wait_generating(http)
        # AReaL's update_weights: pause (no body), the update, continue (no body).
        assert http.post("/pause_generation").status_code == 200
        time.sleep(0.2)
        assert http.post("/continue_generation").status_code == 200
        thread.join(timeout=120)
    got = box["result"]
    assert got["interrupted"] >= 1
    assert got["tokens"] == reference["tokens"] and got["stop_reason"] == reference["stop_reason"]
    assert got["logprobs"] == pytest.approx(reference["logprobs"], abs=1e-4)


def test_pause_and_continue_through_the_engine(engine):
    params = areal_payload(PROMPT_IDS, 1500, greedy=True)
    thread, box = run_in_thread(lambda: engine_generate(engine, params))
    before = engine.get_server_info()["generated_tokens"]
    deadline = time.monotonic() + 60
    while engine.get_server_info()["generated_tokens"] < before + 10:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    engine.pause_generation()
    thread.join(timeout=60)
    engine.continue_generation()
    out = box["result"]
    assert_generate_shape(out, logprobs=True)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 1500
