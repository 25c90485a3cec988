"""LoRA over HTTP (`rollout serve --lora-paths`): /v1/models lists the adapters, the OpenAI API
picks one with model="<model>:<adapter>", /generate with lora_path, and the admin-only
/load_lora_adapter and /unload_lora_adapter, which read only under --allowed-weight-roots."""

from __future__ import annotations

import httpx
import pytest
from hf_reference import greedy_of
from lora_helpers import make_peft_adapter, peft_model
from server_helpers import start_server, stop_server

pytest.importorskip("peft")

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37]
NEW = 6


@pytest.fixture(scope="module")
def setup(tiny_qwen3, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-roots")
    outside = tmp_path_factory.mktemp("lora-outside")
    a = make_peft_adapter(tiny_qwen3, str(root / "a"), 4, 8, "all-linear", seed=1)
    b = make_peft_adapter(tiny_qwen3, str(root / "b"), 8, 8, ["o_proj", "up_proj"], seed=2)
    c = make_peft_adapter(tiny_qwen3, str(outside / "c"), 4, 4, ["q_proj"], seed=3)
    want = {
        name: greedy_of(peft_model(tiny_qwen3, path), [PROMPT], NEW)[0]
        for name, path in (("a", a), ("b", b))
    }
    proc, url = start_server(
        tiny_qwen3, "--lora-paths", f"a={a}", "--max-lora-rank", "8", "--admin-api-key", "admin",
        "--allowed-weight-roots", str(root), api_key="admin",
    )  # fmt: skip
    try:
        yield {"url": url, "model": tiny_qwen3, "b": b, "c": c, "want": want}
    finally:
        stop_server(proc)


def _post(setup, path, body, key="admin"):
    return httpx.post(f"{setup['url']}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})  # fmt: skip


def test_models_lists_the_adapters_and_completions_pick_one(setup):
    models = httpx.get(f"{setup['url']}/v1/models", headers={"Authorization": "Bearer admin"})
    ids = [m["id"] for m in models.json()["data"]]
    assert ids == [setup["model"], f"{setup['model']}:a"]
    card = httpx.get(f"{setup['url']}/v1/models/{setup['model']}:a", headers={"Authorization": "Bearer admin"})
    assert card.status_code == 200 and card.json()["parent"] == setup["model"]
    body = {"model": f"{setup['model']}:a", "prompt": PROMPT, "max_tokens": NEW,
            "temperature": 0, "ignore_eos": True, "logprobs": 1}  # fmt: skip
    out = _post(setup, "/v1/completions", body)
    assert out.status_code == 200, out.text
    tokens = out.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == NEW
    native = _post(setup, "/generate", {"input_ids": PROMPT, "lora_path": "a",
                                        "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})  # fmt: skip
    assert native.json()["output_ids"] == setup["want"]["a"]
    missing = _post(setup, "/v1/completions", {**body, "model": f"{setup['model']}:nope"})
    assert missing.status_code == 400 and "no LoRA adapter named 'nope'" in missing.text


def test_loading_is_admin_only_and_reads_only_under_the_roots(setup):
    body = {"lora_name": "b", "lora_path": setup["b"]}
    assert _post(setup, "/load_lora_adapter", body, key="wrong").status_code in (401, 403)
    outside = _post(setup, "/load_lora_adapter", {"lora_name": "c", "lora_path": setup["c"]})
    assert outside.status_code == 403 and "not under an allowed root" in outside.text
    loaded = _post(setup, "/load_lora_adapter", body)
    assert loaded.status_code == 200 and loaded.json()["lora_adapters"].keys() == {"a", "b"}
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    out = _post(setup, "/generate", {"input_ids": PROMPT, "lora_path": "b", "sampling_params": params})
    assert out.json()["output_ids"] == setup["want"]["b"]
    assert _post(setup, "/unload_lora_adapter", {"lora_name": "b"}).status_code == 200
    gone = _post(setup, "/generate", {"input_ids": PROMPT, "lora_path": "b", "sampling_params": params})
    assert gone.status_code == 400 and "no LoRA adapter named 'b'" in gone.text


def test_a_name_no_answer_can_hold_is_refused_and_loads_nothing(setup):
    body = b'{"lora_name": "s\\ud800", "lora_path": "%s"}' % setup["b"].encode()
    refused = httpx.post(f"{setup['url']}/load_lora_adapter", content=body, timeout=60,
                         headers={"Authorization": "Bearer admin", "content-type": "application/json"})  # fmt: skip
    assert refused.status_code == 400 and "lora_name is not valid Unicode" in refused.text
    models = httpx.get(f"{setup['url']}/v1/models", headers={"Authorization": "Bearer admin"})
    assert models.status_code == 200 and len(models.json()["data"]) == 2


def test_a_load_body_of_the_wrong_types_is_refused_not_converted(setup):
    body = {"lora_name": "p", "lora_path": setup["b"], "pinned": "yes"}
    refused = _post(setup, "/load_lora_adapter", body)
    assert refused.status_code == 400 and "pinned" in refused.text
    models = httpx.get(f"{setup['url']}/v1/models", headers={"Authorization": "Bearer admin"})
    assert "p" not in {m["id"].rsplit(":", 1)[-1] for m in models.json()["data"]}
