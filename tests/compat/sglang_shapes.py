"""SGLang's response shapes, as its RL clients read them, and the calls those clients make, run
both over HTTP (the payload as sent) and through the Engine API (the same fields as keywords)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import httpx
import torch
from safetensors.torch import load_file

# Headers slime and verl send to every call; `Bearer None` when the server has no key.
NO_KEY_HEADERS = {"Content-Type": "application/json; charset=utf-8", "Authorization": "Bearer None"}


def assert_generate_shape(out: dict, logprobs: bool) -> None:
    """One /generate output as SGLang gives it (and slime, verl, AReaL read it)."""
    assert isinstance(out["text"], str) and isinstance(out["output_ids"], list)
    meta = out["meta_info"]
    for key, kind in (("id", str), ("prompt_tokens", int), ("completion_tokens", int),
                      ("cached_tokens", int), ("weight_version", str), ("e2e_latency", float)):  # fmt: skip
        assert isinstance(meta[key], kind), (key, meta.get(key))
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert meta["completion_tokens"] == len(out["output_ids"])
    spans = meta["weight_versions"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == len(out["output_ids"])
    assert spans[-1]["version"] == meta["weight_version"]
    if logprobs:
        entries = meta["output_token_logprobs"]
        assert [e[1] for e in entries] == out["output_ids"]  # [logprob, token id, text]
        assert all(isinstance(e[0], float) and len(e) == 3 for e in entries)


def engine_generate(engine: Any, payload: dict) -> Any:
    """The /generate payload through the Engine API: the same fields, `text` as `prompt`."""
    kwargs = {("prompt" if k == "text" else k): v for k, v in payload.items()}
    return engine.generate(**kwargs)


def run_in_thread(fn: Any) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def wait_generating(http: httpx.Client, at_least: int = 10, timeout: float = 60) -> None:
    """Waits until the server generated `at_least` more tokens (a request is running)."""
    start = http.get("/get_server_info").json()["generated_tokens"]
    deadline = time.monotonic() + timeout
    while http.get("/get_server_info").json()["generated_tokens"] < start + at_least:
        assert time.monotonic() < deadline, "no request started generating"
        time.sleep(0.02)


def checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of a tiny checkpoint's model.safetensors."""
    return list(load_file(os.path.join(path, "model.safetensors")).items())
