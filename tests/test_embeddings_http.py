"""The embedding, reward and scoring endpoints over HTTP (/classify, /encode, /v1/embeddings,
/v1/score, /v1/rerank) and RolloutClient's twins, against transformers in float32."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from hf_reference import hf_last_hidden, hf_next_logprobs, hf_scores, tokenizer
from server_helpers import start_server, stop_server

from rollout.client import RolloutClient
from rollout.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("rm-http")), "qwen2", seed=7, num_labels=1)


@pytest.fixture(scope="module")
def rm_server(reward_model):
    proc, url = start_server(reward_model, "--is-embedding", "--served-model-name", "rm")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def embed_server(tiny_qwen3):
    proc, url = start_server(tiny_qwen3, "--is-embedding", "--served-model-name", "emb")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def rm_client(rm_server):
    with RolloutClient(rm_server) as c:
        yield c


@pytest.fixture(scope="module")
def embed_client(embed_server):
    with RolloutClient(embed_server) as c:
        yield c


PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog.", "1 2 3"]
TOL = 1e-4


def _ids(text: str, path: str) -> list[int]:
    return tokenizer(path).encode(text)


def test_classify_native_shape_and_values(rm_server, reward_model):
    resp = httpx.post(f"{rm_server}/classify", json={"text": PROMPTS})
    assert resp.status_code == 200
    outs = resp.json()
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        want = hf_scores(reward_model, _ids(prompt, reward_model))
        assert torch.allclose(torch.tensor(out["embedding"]), want, atol=TOL)
        assert out["meta_info"]["prompt_tokens"] == len(_ids(prompt, reward_model))


def test_client_classify_messages_and_ids(rm_client, reward_model):
    chat = [{"role": "user", "content": "Add 3 and 4."}, {"role": "assistant", "content": "7"}]
    out = rm_client.classify(messages=chat)
    tok = tokenizer(reward_model)
    ids = tok.encode(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
    assert torch.allclose(torch.tensor(out["embedding"]), hf_scores(reward_model, ids), atol=TOL)
    by_ids = rm_client.classify(input_ids=[ids, ids[:5]])
    assert by_ids[0]["embedding"] == pytest.approx(out["embedding"], abs=TOL)
    assert torch.allclose(torch.tensor(by_ids[1]["embedding"]), hf_scores(reward_model, ids[:5]), atol=TOL)


def test_rerank_with_a_cross_encoder(rm_client, reward_model):
    tok = tokenizer(reward_model)
    query, docs = "What is 6 times 7?", ["The answer is 42.", "Hello there!", "Water boils at 100 degrees."]
    results = rm_client.rerank(query, docs)
    want = [hf_scores(reward_model, tok(query, d)["input_ids"])[0].item() for d in docs]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    for r in results:
        assert r["score"] == pytest.approx(want[r["index"]], abs=TOL)
        assert r["document"] == docs[r["index"]]
    assert len(rm_client.rerank(query, docs, top_n=1)) == 1


def test_generation_on_an_embedding_server_is_a_clear_400(rm_server, rm_client):
    resp = httpx.post(f"{rm_server}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 400 and "is_embedding" in resp.json()["error"]["message"]
    with pytest.raises(ValueError, match="classifier"):
        rm_client.score("a", ["b"], [1])
    assert rm_client.get_model_info()["is_generation"] is False
    oai = openai.OpenAI(base_url=f"{rm_server}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="is_embedding"):
        oai.completions.create(model="rm", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="is_embedding"):
        oai.chat.completions.create(model="rm", messages=[{"role": "user", "content": "hi"}])


def test_encode_and_openai_embeddings(embed_server, embed_client, tiny_qwen3):
    outs = embed_client.encode(PROMPTS, normalize=False)
    oai = openai.OpenAI(base_url=f"{embed_server}/v1", api_key="unused")
    resp = oai.embeddings.create(model="emb", input=PROMPTS)
    assert [d.index for d in resp.data] == list(range(len(PROMPTS)))
    total = 0
    for prompt, out, item in zip(PROMPTS, outs, resp.data):
        ids = _ids(prompt, tiny_qwen3)
        want = hf_last_hidden(tiny_qwen3, ids)
        assert torch.allclose(torch.tensor(out["embedding"]), want, atol=TOL)
        assert torch.allclose(torch.tensor(item.embedding), want, atol=TOL)
        total += len(ids)
    assert resp.usage.prompt_tokens == total
    by_ids = httpx.post(
        f"{embed_server}/v1/embeddings", json={"model": "emb", "input": _ids(PROMPTS[0], tiny_qwen3)}
    ).json()
    assert by_ids["object"] == "list" and by_ids["data"][0]["object"] == "embedding"
    assert by_ids["data"][0]["embedding"] == pytest.approx(outs[0]["embedding"], abs=TOL)
    unit = embed_client.encode(PROMPTS[0], normalize=True)["embedding"]
    assert torch.tensor(unit).norm().item() == pytest.approx(1.0, abs=1e-5)
    bad = httpx.post(f"{embed_server}/v1/embeddings", json={"model": "other", "input": "hi"})
    assert bad.status_code == 404


def test_score_over_http(embed_server, embed_client, tiny_qwen3):
    labels = [10, 20, 30]
    query, items = "The answer is", [" 42", " two"]
    scores = embed_client.score(query, items, labels, apply_softmax=True)
    raw = httpx.post(
        f"{embed_server}/v1/score", json={"query": query, "items": items, "label_token_ids": labels}
    ).json()
    assert raw["object"] == "scoring" and len(raw["scores"]) == 2
    for item, soft, probs in zip(items, scores, raw["scores"]):
        lp = hf_next_logprobs(tiny_qwen3, _ids(query + item, tiny_qwen3))[labels]
        assert torch.allclose(torch.tensor(soft, dtype=torch.float32), torch.softmax(lp, -1), atol=TOL)
        assert torch.allclose(torch.tensor(probs, dtype=torch.float32), lp.exp(), atol=TOL)


def test_rerank_with_an_embedder_uses_cosine_similarity(embed_client):
    query, docs = "The quick brown fox", ["The quick brown fox jumps", "1 2 3"]
    results = embed_client.rerank(query, docs)
    vecs = embed_client.encode([query, *docs], normalize=True)
    q = torch.tensor(vecs[0]["embedding"])
    for r in results:
        cos = (q @ torch.tensor(vecs[1 + r["index"]]["embedding"])).item()
        assert r["score"] == pytest.approx(cos, abs=TOL)
    assert results[0]["score"] >= results[1]["score"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [1], "apply_softmax": "yes"}, "apply_softmax"),
     ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": "1"}, "top_n"),
     ("/encode", {"text": "q", "normalize": 1}, "normalize")],
)  # fmt: skip
def test_a_body_of_the_wrong_types_is_refused_not_converted(embed_server, path, body, field):
    answer = httpx.post(f"{embed_server}{path}", json=body)
    assert answer.status_code == 400 and field in answer.text, answer.text[:300]
