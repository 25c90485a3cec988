"""slime's generation and control calls, as its code sends them (THUDM/slime:
slime/rollout/sglang_rollout.py `generate`, slime/backends/sglang_utils/sglang_engine.py and
server_control.py), over HTTP and through the Engine API, answered in SGLang's shapes.

- launch: GET /health_generate then GET /flush_cache until 200, with `Authorization: Bearer None`
  when the server has no key; an external engine's GET /get_server_info is checked;
- rollout: POST /generate {"sampling_params", "return_logprob": true, "input_ids"}, sampling
  params from GenerateState (no_stop_trim, spaces_between_special_tokens false, custom_params
  when top_p < 1, sampling_seed per group member under deterministic inference);
- abort: POST /abort_request {"abort_all": true}, then GET /v1/loads?include=core,disagg,queues
  until no request is left; a partial sample resumes with prompt + its tokens and
  max_new_tokens less its response length;
- GET /get_weight_version, POST /pause_generation {} and /continue_generation {}.
"""

from __future__ import annotations

import httpx
import pytest
from sglang_shapes import (
    NO_KEY_HEADERS,
    assert_generate_shape,
    engine_generate,
    run_in_thread,
    wait_generating,
)

PROMPT = [11, 305, 27, 88, 413, 9, 56]
MAX_RESPONSE = 24


def slime_sampling_params(top_p: float = 1.0, seed: int | None = None) -> dict:
    """GenerateState.sampling_params, with what generate_and_rm_group adds per sample."""
    params = dict(
        temperature=1.0,
        top_p=top_p,
        top_k=-1,
        max_new_tokens=MAX_RESPONSE,
        stop=None,
        stop_token_ids=None,
        skip_special_tokens=True,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )
    if top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def num_requests_from_load(load: dict) -> int:
    """What slime's abort loop counts in a /v1/loads answer (its per-rank request counters)."""
    return sum(rank["num_total_reqs"] for rank in load["loads"])


def test_launch_and_external_engine_checks(server):
    with httpx.Client(base_url=server, headers=NO_KEY_HEADERS, timeout=60) as http:
        assert http.get("/health_generate").status_code == 200
        assert http.get("/flush_cache").status_code == 200
        info = http.get("/get_server_info").json()
    for key in ("tp_size", "dp_size", "max_total_num_tokens", "version", "weight_version"):
        assert key in info, key
    assert info["tp_size"] == 1 and info["dp_size"] == 1


@pytest.mark.parametrize("top_p, seeds", [(1.0, None), (0.9, [1234, 1235])])
def test_rollout_generate_payload_over_http_and_the_engine(server, engine, top_p, seeds):
    for seed in seeds or [None]:
        payload = {
            "sampling_params": slime_sampling_params(top_p, seed),
            "return_logprob": True,
            "input_ids": PROMPT,
        }
        out = httpx.post(f"{server}/generate", json=payload, timeout=60).json()
        assert_generate_shape(out, logprobs=True)
        tokens = [item[1] for item in out["meta_info"]["output_token_logprobs"]]
        assert 0 < len(tokens) <= MAX_RESPONSE
        local = engine_generate(engine, payload)
        assert_generate_shape(local, logprobs=True)
        if seed is not None:  # the same seed draws the same tokens on either path
            assert local["output_ids"] == out["output_ids"]


def test_abort_until_idle_then_resume_the_partial_sample(server):
    greedy = {**slime_sampling_params(), "temperature": 0.0, "max_new_tokens": 1500}
    payload = {"sampling_params": greedy, "return_logprob": True, "input_ids": PROMPT}
    thread, box = run_in_thread(
        lambda: httpx.post(f"{server}/generate", json=payload, timeout=120).json()
    )
    with httpx.Client(base_url=server, timeout=60) as http:
        wait_generating(http)
        assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
        thread.join(timeout=60)
        load = http.get("/v1/loads?include=core,disagg,queues").json()
        assert num_requests_from_load(load) == 0
    partial = box["result"]
    assert_generate_shape(partial, logprobs=True)
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    response = [item[1] for item in partial["meta_info"]["output_token_logprobs"]]
    assert 0 < len(response) < 1500
    # The whole sample, for a budget the abort left 20 tokens of (however many came before it).
    budget = len(response) + 20
    whole = httpx.post(
        f"{server}/generate",
        json={"sampling_params": {**greedy, "max_new_tokens": budget}, "return_logprob": True,
              "input_ids": PROMPT},
        timeout=120,
    ).json()  # fmt: skip
    # slime's generate on an ABORTED sample: the tokens so far, the budget less the response.
    params = {**greedy, "max_new_tokens": budget - len(response)}
    rest = httpx.post(
        f"{server}/generate",
        json={"sampling_params": params, "return_logprob": True, "input_ids": PROMPT + response},
        timeout=120,
    ).json()
    assert response + rest["output_ids"] == whole["output_ids"]


def test_version_pause_and_continue_calls(server, engine):
    with httpx.Client(base_url=server, timeout=60) as http:
        assert http.get("/get_weight_version").json() == {"weight_version": "default"}
        r = http.post("/pause_generation", json={})
        assert r.status_code == 200, r.text
        r = http.post("/continue_generation", json={})
        assert r.status_code == 200 and r.json()["success"], r.text
    assert engine.get_weight_version() == "default"
    engine.pause_generation()
    assert engine.continue_generation()["success"]
    engine.abort_request(abort_all=True)
    assert engine.flush_cache()["success"]
