"""Reward and embedding models through the engine: classify / encode / score against a
transformers forward in float32, batched, through the prefix cache and chunked prefill."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hf_reference import hf_last_hidden, hf_next_logprobs, hf_scores

from rollout import RolloutEngine
from rollout.tiny_model import make_tiny_model

CPU = {"device": "cpu", "dtype": "float32"}
PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over the lazy dog.",
    "1 2 3",
    "Once upon a time there was a small village by the sea, where the people fished and sang.",
]
TOL = 1e-4


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("rm-qwen3")), "qwen3", seed=5, num_labels=1)


@pytest.fixture(scope="module")
def llama_classifier(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("cls-llama")), "llama", seed=6, num_labels=3)


@pytest.fixture(scope="module")
def rm_engine(reward_model):
    with RolloutEngine(reward_model, is_embedding=True, **CPU) as e:
        yield e


@pytest.fixture(scope="module")
def chunked_classifier(llama_classifier):
    # Prompts longer than 8 tokens prefill in several chunks: only the last one pools.
    with RolloutEngine(llama_classifier, is_embedding=True, chunked_prefill_size=8, **CPU) as e:
        yield e


@pytest.fixture(scope="module")
def embedder(tiny_qwen2):
    with RolloutEngine(tiny_qwen2, is_embedding=True, **CPU) as e:
        yield e


@pytest.fixture(scope="module")
def generator(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, **CPU) as e:
        yield e


def test_reward_model_classify_batch_matches_transformers(rm_engine, reward_model):
    outs = rm_engine.classify(PROMPTS)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        ids = rm_engine.tokenizer.encode(prompt)
        want = hf_scores(reward_model, ids)
        assert len(out["embedding"]) == 1
        assert torch.allclose(torch.tensor(out["embedding"]), want, atol=TOL)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["id"]


def test_classify_single_prompt_gives_one_dict_and_frees_kv(rm_engine):
    out = rm_engine.classify(PROMPTS[1])
    assert isinstance(out, dict) and isinstance(out["embedding"], list)
    info = rm_engine.get_server_info()
    assert info["num_running"] == 0 and info["kv_whole"]


def test_classify_messages_go_through_the_chat_template(rm_engine, reward_model):
    chats = [
        [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}],
        [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "12"}],
    ]
    outs = rm_engine.classify(messages=chats)
    single = rm_engine.classify(messages=chats[0])
    for chat, out in zip(chats, outs):
        text = rm_engine.tokenizer.apply_chat_template(chat, tokenize=False)
        ids = rm_engine.tokenizer.encode(text, add_special_tokens=False)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert torch.allclose(torch.tensor(out["embedding"]), hf_scores(reward_model, ids), atol=TOL)
    assert single["embedding"] == pytest.approx(outs[0]["embedding"], abs=TOL)


def test_multilabel_classifier_chunked_prefill_and_ids(chunked_classifier, llama_classifier):
    ids = [chunked_classifier.tokenizer.encode(p) for p in PROMPTS]
    outs = chunked_classifier.classify(input_ids=ids)
    again = chunked_classifier.classify(input_ids=ids)  # prefixes now come from the cache
    for seq, out, out2 in zip(ids, outs, again):
        want = hf_scores(llama_classifier, seq)
        assert len(out["embedding"]) == 3
        assert torch.allclose(torch.tensor(out["embedding"]), want, atol=TOL)
        assert torch.allclose(torch.tensor(out2["embedding"]), want, atol=TOL)
    assert max(o["meta_info"]["cached_tokens"] for o in again) > 0


def test_encode_causal_lm_last_token_hidden_state(embedder, tiny_qwen2):
    outs = embedder.encode(PROMPTS)
    normed = embedder.encode(PROMPTS, normalize=True)
    for prompt, out, unit in zip(PROMPTS, outs, normed):
        want = hf_last_hidden(tiny_qwen2, embedder.tokenizer.encode(prompt))
        assert torch.allclose(torch.tensor(out["embedding"]), want, atol=TOL)
        unit_vec = torch.tensor(unit["embedding"])
        assert unit_vec.norm().item() == pytest.approx(1.0, abs=1e-5)
        assert torch.allclose(unit_vec, torch.nn.functional.normalize(want, dim=-1), atol=TOL)


def test_async_encode_concurrent_calls(embedder):
    async def many():
        return await asyncio.gather(*(embedder.async_encode(p) for p in PROMPTS))

    outs = asyncio.run(many())
    want = embedder.encode(PROMPTS)
    for got, ref in zip(outs, want):
        assert got["embedding"] == pytest.approx(ref["embedding"], abs=TOL)


def test_encode_and_score_share_batches(embedder):
    """An embedding engine on a causal LM also scores: both kinds in one prefill come out as
    they do alone (pooled rows skip sampling; scored rows sample one greedy token)."""

    async def both():
        return await asyncio.gather(
            embedder.async_encode(PROMPTS), embedder.async_score("The answer is", [" 1", " 2"], [5, 6])
        )

    encoded, scored = asyncio.run(both())
    alone = embedder.encode(PROMPTS)
    assert [o["embedding"] for o in encoded] == [pytest.approx(a["embedding"], abs=TOL) for a in alone]
    assert scored == [pytest.approx(r, abs=1e-6) for r in embedder.score("The answer is", [" 1", " 2"], [5, 6])]


def test_score_text_matches_transformers(generator, tiny_qwen3):
    labels = [10, 20, 30]
    query, items = "The answer is", [" 42", " two", " yes"]
    probs = generator.score(query, items, labels)
    soft = generator.score(query, items, labels, apply_softmax=True)
    first = generator.score(query, items, labels, item_first=True)
    assert len(probs) == len(items)
    for item, row, srow, frow in zip(items, probs, soft, first):
        lp = hf_next_logprobs(tiny_qwen3, generator.tokenizer.encode(query + item))[labels]
        assert torch.allclose(torch.tensor(row, dtype=torch.float32), lp.exp(), atol=TOL)
        assert torch.allclose(torch.tensor(srow, dtype=torch.float32), torch.softmax(lp, -1), atol=TOL)
        assert sum(srow) == pytest.approx(1.0)
        lp_first = hf_next_logprobs(tiny_qwen3, generator.tokenizer.encode(item + query))[labels]
        assert torch.allclose(torch.tensor(frow, dtype=torch.float32), lp_first.exp(), atol=TOL)


def test_score_token_ids(generator, tiny_qwen3):
    query, items, labels = [5, 6, 7], [[8, 9], [10]], [3, 4]
    probs = generator.score(query, items, labels)
    for item, row in zip(items, probs):
        lp = hf_next_logprobs(tiny_qwen3, query + item)[labels]
        assert torch.allclose(torch.tensor(row, dtype=torch.float32), lp.exp(), atol=TOL)


def test_embedding_engine_refuses_generation(rm_engine, embedder):
    for engine in (rm_engine, embedder):
        with pytest.raises(ValueError, match="is_embedding"):
            engine.generate("hi", {"max_new_tokens": 2})


def test_wrong_mode_errors(generator, rm_engine, reward_model):
    with pytest.raises(ValueError, match="is_embedding=True"):
        generator.encode("hi")
    with pytest.raises(ValueError, match="classifier"):
        rm_engine.score("a", ["b"], [1])
    with pytest.raises(ValueError, match="is_embedding=True"):
        RolloutEngine(reward_model, **CPU)
    with pytest.raises(ValueError, match="label_token_ids"):
        generator.score("a", ["b"], [])
    with pytest.raises(ValueError, match="exactly one"):
        rm_engine.classify("hi", messages=[{"role": "user", "content": "hi"}])


def test_tiny_model_cli_writes_a_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rollout.cli import main

    main(["tiny-model", str(tmp_path / "rm"), "--arch", "qwen2", "--num-labels", "2"])
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"))
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    assert tuple(model.score.weight.shape) == (2, 64)
