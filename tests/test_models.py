"""Model files against transformers: logits, cached prefixes, decode, weight loading, errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from forward_helpers import forward_batch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rollout.forward.forward_batch import ForwardMode
from rollout.forward.kv_pool import KVPool, ReqToTokenPool
from rollout.models import get_model_class
from rollout.models.layers import RotaryEmbedding
from rollout.models.llama import head_dim_of
from rollout.models.loader import build_model, iter_safetensors, load_model, resolve_dtype
from rollout.tiny_model import make_tiny_model

ARCHS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3"]
MAX_LEN = 256  # KV slots per request in these tests
TOL = 1e-4


class Cache:
    """KV pool and req->token table where request i owns slots 1 + MAX_LEN*i, 2 + MAX_LEN*i, ..."""

    def __init__(self, config, num_reqs: int = 4) -> None:
        self.kv = KVPool(
            config.num_hidden_layers,
            num_reqs * MAX_LEN,
            config.num_key_value_heads,
            head_dim_of(config),
            torch.float32,
            "cpu",
        )
        self.table = ReqToTokenPool(num_reqs, MAX_LEN, "cpu")
        for i in range(num_reqs):
            self.table.write(i, 0, torch.arange(1 + i * MAX_LEN, 1 + (i + 1) * MAX_LEN))


def run(model, cache: Cache, seqs: list[list[int]], cached: list[int], mode=ForwardMode.EXTEND):
    """One forward of seqs[i][cached[i]:] on top of KV that already holds seqs[i][:cached[i]].
    Returns the logits of the new tokens, back to back: [sum of new lengths, vocab]."""
    fb = forward_batch(cache.kv, cache.table, seqs, cached, mode)
    with torch.no_grad():
        return model.compute_logits(model(fb.input_ids, fb.positions, fb))


def hf_logits(hf, seqs: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in seqs]


def random_seqs(config, lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in lens]


def load_pair(path: str):
    config = AutoConfig.from_pretrained(path)
    ours = load_model(path, config, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return config, ours, hf


@pytest.mark.parametrize("fixture", ARCHS)
def test_ragged_prefill_matches_transformers(fixture, request):
    config, ours, hf = load_pair(request.getfixturevalue(fixture))
    seqs = random_seqs(config, (5, 37, 90))
    logits = run(ours, Cache(config), seqs, [0, 0, 0])
    for got, ref in zip(logits.split([5, 37, 90]), hf_logits(hf, seqs)):
        assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("fixture", ARCHS)
def test_cached_prefix_extend_then_decode_matches_one_full_forward(fixture, request):
    config, ours, hf = load_pair(request.getfixturevalue(fixture))
    full = random_seqs(config, (9, 40, 70), seed=1)
    refs = hf_logits(hf, full)
    prompt_lens, cut, steps = [6, 37, 67], [2, 20, 61], 3
    cache = Cache(config)
    run(ours, cache, [s[:c] for s, c in zip(full, cut)], [0, 0, 0])
    logits = run(ours, cache, [s[:n] for s, n in zip(full, prompt_lens)], cut)
    rows = logits.split([n - c for n, c in zip(prompt_lens, cut)])
    for got, ref, c, n in zip(rows, refs, cut, prompt_lens):
        assert (got - ref[c:n]).abs().max().item() <= TOL
    for step in range(steps):
        lens = [n + step + 1 for n in prompt_lens]
        logits = run(
            ours,
            cache,
            [s[:n] for s, n in zip(full, lens)],
            [n - 1 for n in lens],
            ForwardMode.DECODE,
        )
        for got, ref, n in zip(logits, refs, lens):
            assert (got - ref[n - 1]).abs().max().item() <= TOL


@pytest.mark.parametrize("fixture", ARCHS)
def test_greedy_generation_matches_transformers_generate(fixture, request):
    path = request.getfixturevalue(fixture)
    config, ours, hf = load_pair(path)
    tok = AutoTokenizer.from_pretrained(path)
    questions = ["Hi", "What is 3 plus 4?", "Tell me a story about the village by the sea."]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    prompts = [tok(t).input_ids for t in texts]
    cache, seqs = Cache(config), [list(p) for p in prompts]
    logits = run(ours, cache, seqs, [0] * len(seqs))
    last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    for step in range(8):
        for seq, token in zip(seqs, logits[last].argmax(-1).tolist()):
            seq.append(token)
        if step < 7:
            logits = run(ours, cache, seqs, [len(s) - 1 for s in seqs], ForwardMode.DECODE)
            last = torch.arange(len(seqs))
    generated = []
    for prompt, seq in zip(prompts, seqs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )
        expected = out[0, len(prompt) :].tolist()
        ours_new = seq[len(prompt) :]
        if config.eos_token_id in ours_new:  # transformers stops after the first eos
            ours_new = ours_new[: ours_new.index(config.eos_token_id) + 1]
        assert ours_new == expected
        generated += ours_new
    assert len(set(generated)) > 3, "tiny model output is degenerate"


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {"rope_scaling": None}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 4}),
        ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}),
        ("qwen2", {"num_key_value_heads": 1}),
    ],
)
def test_config_variants_match_transformers_with_weights_from_memory(arch, overrides, tmp_path):
    path = make_tiny_model(str(tmp_path), arch, seed=3, **overrides)
    config = AutoConfig.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-inits biases; make every tensor's placement matter
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = build_model(config, torch.float32, "cpu").eval()
    loaded = ours.load_weights(hf.state_dict().items())
    assert loaded == set(ours.hf_param_shapes())
    seqs = random_seqs(config, (3, 50), seed=2)
    logits = run(ours, Cache(config), seqs, [0, 0])
    for got, ref in zip(logits.split([3, 50]), hf_logits(hf, seqs)):
        assert (got - ref).abs().max().item() <= TOL


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    whole = make_tiny_model(str(tmp_path / "whole"), "qwen3", seed=5)
    sharded = make_tiny_model(str(tmp_path / "sharded"), "qwen3", seed=5, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    config = AutoConfig.from_pretrained(whole)
    a = dict(load_model(whole, config, torch.float32, "cpu").named_parameters())
    b = dict(load_model(sharded, config, torch.float32, "cpu").named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("fixture", ARCHS)
def test_hf_param_shapes_lists_exactly_the_checkpoint(fixture, request):
    path = request.getfixturevalue(fixture)
    model = load_model(path, AutoConfig.from_pretrained(path), torch.float32, "cpu")
    on_disk = {name: (tuple(t.shape), t.dtype) for name, t in iter_safetensors(path)}
    assert model.hf_param_shapes() == on_disk


def test_load_weights_errors_and_partial_updates(tiny_llama):
    model = load_model(tiny_llama, AutoConfig.from_pretrained(tiny_llama), torch.float32, "cpu")
    name = "model.layers.1.self_attn.k_proj.weight"
    shape, dtype = model.hf_param_shapes()[name]
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        model.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(shape))])
    bad = (shape[0] + 1, shape[1])
    with pytest.raises(ValueError, match=rf"'{name}': expected \[32, 64\], got \[33, 64\]"):
        model.load_weights([(name, torch.zeros(bad))])

    before = {n: p.clone() for n, p in model.named_parameters()}
    new = torch.randn(shape, dtype=torch.float64)  # cast on copy
    ignored = ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))
    assert model.load_weights([(name, new), ignored]) == {name}
    attn = model.model.layers[1].self_attn
    k_rows = attn.qkv_proj.weight[attn.q_size : attn.q_size + attn.kv_size]
    assert torch.equal(k_rows, new.to(dtype))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"model.layers.1.self_attn.qkv_proj.weight"}


def test_tied_head_accepts_and_ignores_lm_head(tiny_qwen2):
    model = load_model(tiny_qwen2, AutoConfig.from_pretrained(tiny_qwen2), torch.float32, "cpu")
    assert "lm_head.weight" not in model.hf_param_shapes()
    embed = model.model.embed_tokens.weight.clone()
    assert model.load_weights([("lm_head.weight", torch.zeros_like(embed))]) == set()
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(model.compute_logits(embed[:2]), embed[:2] @ embed.T)


def test_bfloat16_load_and_dummy_weights(tiny_qwen3):
    config = AutoConfig.from_pretrained(tiny_qwen3)
    model = load_model(tiny_qwen3, config, torch.bfloat16, "cpu")
    assert torch.get_default_dtype() == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    fp32 = load_model(tiny_qwen3, config, torch.float32, "cpu")
    seqs = random_seqs(config, (12,))
    low, high = run(model, Cache(config), seqs, [0]), run(fp32, Cache(config), seqs, [0])
    assert low.dtype == torch.float32
    assert (low - high).abs().max().item() < 0.05 * high.abs().max().item()

    dummy = load_model(tiny_qwen3, config, torch.float32, "cpu", load_format="dummy")
    assert torch.isfinite(run(dummy, Cache(config), seqs, [0])).all()
    with pytest.raises(ValueError, match="load_format must be auto or dummy"):
        load_model(tiny_qwen3, config, torch.float32, "cpu", load_format="pt")


def test_checkpoint_missing_a_tensor_is_rejected(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_model(str(tmp_path), "llama", seed=0)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 parameters.*mlp.gate_proj"):
        load_model(path, AutoConfig.from_pretrained(path), torch.float32, "cpu")


def test_unsupported_architecture_and_rope_are_clear_errors(tiny_qwen2):
    config = AutoConfig.from_pretrained(tiny_qwen2)
    config.architectures = ["MambaForCausalLM"]
    with pytest.raises(ValueError, match=r"unsupported architecture.*LlamaForCausalLM"):
        get_model_class(config)
    config = AutoConfig.from_pretrained(tiny_qwen2)
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type must be one of"):
        RotaryEmbedding(config, 16)


def test_resolve_dtype(tiny_llama):
    config = AutoConfig.from_pretrained(tiny_llama)
    assert resolve_dtype("auto", config) == torch.float32
    assert resolve_dtype("bfloat16", config) == torch.bfloat16
    config.dtype = "bfloat16"
    assert resolve_dtype("auto", config) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("fp8", config)


def test_tiny_model_is_deterministic_and_consistent(tmp_path, tiny_llama):
    again = make_tiny_model(str(tmp_path), "llama", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        with (
            open(os.path.join(tiny_llama, name), "rb") as a,
            open(os.path.join(again, name), "rb") as b,
        ):
            assert a.read() == b.read(), name
    tok = AutoTokenizer.from_pretrained(again)
    with open(os.path.join(again, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(again, "generation_config.json")) as f:
        generation = json.load(f)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == config["eos_token_id"] == generation["eos_token_id"]
    assert tok.pad_token_id is not None and config["vocab_size"] == len(tok)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
