"""/health latency while one large or hostile /generate body is in flight: prints JSON lines.

    python benchmarks/bench_health_under_load.py
    python benchmarks/bench_health_under_load.py --cases strings,token_ids --runs 5
    python benchmarks/bench_health_under_load.py --server-tree /tmp/other_tree  # its rollout/

Starts `rollout serve` on a tiny random Qwen3 checkpoint on the CPU, at the default
--max-request-bytes (64 MiB). For each body, one connection posts it to /generate while another
polls /health every few ms, from just before the body is sent until TAIL_S after the answer
(what is left of a body is freed after its answer). A poll waits as long as the event loop is
held: the slowest is how long one request froze the server. Each line has the case, the run, the
answer's status, and the max and p99 of /health latency in ms. The case text_nulls (pydantic
makes an error per item: slow) runs only when named in --cases.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from rollout.client import RolloutClient  # noqa: E402
from rollout.tiny_model import make_tiny_model  # noqa: E402

BODY_BYTES = 50 * 2**20
TAIL_S = 1.0
POLL_GAP_S = 0.005


def _array_body(field: str, item: str, total: int = BODY_BYTES) -> bytes:
    items = ",".join([item] * (total // (len(item) + 1)))
    return f'{{"{field}": [{items}]}}'.encode()


def make_body(case: str) -> bytes:
    """The bodies: each far beyond the tiny model's context, so the engine refuses it (400)."""
    if case == "strings":  # ~10 M strings: no callback from json's C scanner
        return _array_body("input_ids", '"ab"')
    if case == "nulls":
        return _array_body("input_ids", "null")
    if case == "token_ids":  # ~10 M ids
        ids = random.Random(0).choices(range(800), k=BODY_BYTES // 5)
        return json.dumps({"input_ids": ids}).encode()
    if case == "long_text":  # one 60 MB string
        return json.dumps({"text": "hello world " * (60 * 2**20 // 12)}).encode()
    if case == "long_text_escaped":  # one string of ~50 MB with an escape every few characters
        return json.dumps({"text": 'h\u00e9llo\n "w" ' * (BODY_BYTES // 18)}).encode()
    if case == "text_list":  # ~10 M strings, each checked by pydantic (GenerateRequest.prompt)
        return _array_body("text", '"ab"')
    if case == "text_nulls":  # ~10 M nulls where pydantic wants strings: an error for each
        return _array_body("text", "null")
    if case == "empty_lists":  # ~17 M arrays
        return _array_body("input_ids", "[]")
    if case == "batch":  # 2,000 prompts of 5,000 ids
        rng = random.Random(0)
        return json.dumps(
            {"input_ids": [rng.choices(range(800), k=5000) for _ in range(2000)]}
        ).encode()
    raise ValueError(f"unknown case {case!r}")


CASES = [
    "strings",
    "nulls",
    "token_ids",
    "long_text",
    "long_text_escaped",
    "text_list",
    "empty_lists",
    "batch",
]


def health_latencies(url: str, body: bytes) -> tuple[int, list[float]]:
    """Posts body to /generate and polls /health on another connection until TAIL_S after the
    answer. Returns the answer's status and every /health latency in seconds."""
    answer: dict = {}

    def send() -> None:
        headers = {"content-type": "application/json"}
        resp = httpx.post(url + "/generate", content=body, headers=headers, timeout=600)
        answer["status"] = resp.status_code
        answer["at"] = time.monotonic()

    sender = threading.Thread(target=send)
    latencies = []
    # A full collection here (this process holds torch, and the body) would stall the polls.
    gc.collect()
    gc.freeze()
    gc.disable()
    with httpx.Client(base_url=url, timeout=60) as http:
        http.get("/health")
        sender.start()
        while sender.is_alive() or time.monotonic() < answer.get("at", 0) + TAIL_S:
            start = time.monotonic()
            if http.get("/health").status_code != 200:
                raise RuntimeError("/health did not answer 200")
            latencies.append(time.monotonic() - start)
            time.sleep(POLL_GAP_S)
    sender.join()
    gc.enable()
    gc.unfreeze()
    return answer["status"], latencies


def start_server(model_path: str, tree: str | None) -> tuple[subprocess.Popen, str]:
    """`rollout serve`, importing rollout from tree (its working directory) where given."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "rollout.serve", "--model-path", model_path, "--port", str(port)]
    cmd += ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192"]
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = RolloutClient(url)
    try:
        client.wait_ready(timeout=180)
    except BaseException:
        proc.kill()
        raise
    finally:
        client.close()
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server-tree", help="a directory whose rollout/ the server runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, "qwen3", seed=2)
        proc, url = start_server(model, args.server_tree)
        try:
            for case in args.cases.split(","):
                body = make_body(case)
                for run in range(args.runs):
                    status, lat = health_latencies(url, body)
                    lat_ms = sorted(x * 1e3 for x in lat)
                    p99 = lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))]
                    line = {"case": case, "run": run, "body_mb": round(len(body) / 2**20, 1)}
                    line |= {"status": status, "polls": len(lat_ms), "max_ms": round(lat_ms[-1], 1)}
                    print(json.dumps(line | {"p99_ms": round(p99, 1)}), flush=True)
                del body
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
