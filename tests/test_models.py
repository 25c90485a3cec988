"""Model files against transformers: logits, weight loading, errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rollout.engine.attention import create_attention_backend
from rollout.engine.forward_batch import ForwardBatch, ForwardMode
from rollout.engine.kv_pool import KVPool, ReqToTokenPool
from rollout.models.loader import iter_safetensors, load_model
from rollout.tiny_model import make_tiny_model


def _pools(config):
    """A KV pool and a table giving request i the slots 1 + 256 i, 2 + 256 i, ..."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = KVPool(config.num_hidden_layers, 2048, config.num_key_value_heads, head_dim, torch.float32, "cpu")
    table = ReqToTokenPool(8, 256, "cpu")
    for i in range(8):
        table.write(i, 0, torch.arange(1 + i * 256, 1 + (i + 1) * 256))
    return kv, table


def _forward(model, config, seqs: list[list[int]], prefix_lens: list[int], pools):
    """One EXTEND forward of seqs[i][prefix_lens[i]:] on top of KV already holding the prefixes."""
    kv, table = pools
    ids, pos, loc = [], [], []
    for i, (seq, p) in enumerate(zip(seqs, prefix_lens)):
        ids += seq[p:]
        pos += range(p, len(seq))
        loc += table.read(i, p, len(seq)).tolist()
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        out_cache_loc=torch.tensor(loc),
        req_pool_indices=torch.arange(len(seqs)),
        seq_lens=torch.tensor([len(s) for s in seqs]),
        extend_lens=torch.tensor([len(s) - p for s, p in zip(seqs, prefix_lens)]),
        req_to_token=table.table,
        kv_pool=kv,
        attn_backend=create_attention_backend("torch"),
        seq_lens_cpu=[len(s) for s in seqs],
        extend_lens_cpu=[len(s) - p for s, p in zip(seqs, prefix_lens)],
    )
    fb.attn_backend.prepare(fb)
    with torch.no_grad():
        logits = model.compute_logits(model(fb.input_ids, fb.positions, fb))
    return logits


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_logits_equal_transformers_in_a_ragged_batch_and_across_chunks(fixture, request):
    path = request.getfixturevalue(fixture)
    config = AutoConfig.from_pretrained(path)
    ours = load_model(path, config, torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 37, 90)]
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0] for s in seqs]

    logits = _forward(ours, config, seqs, [0, 0, 0], _pools(config))
    start = 0
    for seq, ref in zip(seqs, refs):
        assert (logits[start : start + len(seq)] - ref).abs().max().item() <= 1e-4
        start += len(seq)

    # The same sequences in two steps: a first chunk, then the rest over the cached prefix.
    cut = [2, 20, 61]
    pools = _pools(config)
    _forward(ours, config, [s[:c] for s, c in zip(seqs, cut)], [0, 0, 0], pools)
    logits = _forward(ours, config, seqs, cut, pools)
    start = 0
    for seq, c, ref in zip(seqs, cut, refs):
        n = len(seq) - c
        assert (logits[start : start + n] - ref[c:]).abs().max().item() <= 1e-4
        start += n


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    whole = make_tiny_model(str(tmp_path / "whole"), "qwen3", seed=5)
    sharded = make_tiny_model(str(tmp_path / "sharded"), "qwen3", seed=5, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    config = AutoConfig.from_pretrained(whole)
    a = load_model(whole, config, torch.float32, torch.device("cpu"))
    b = load_model(sharded, config, torch.float32, torch.device("cpu"))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_load_weights_names_shapes_and_partial_updates(tiny_llama):
    config = AutoConfig.from_pretrained(tiny_llama)
    model = load_model(tiny_llama, config, torch.float32, torch.device("cpu"))
    expected = model.hf_param_shapes()
    hf_names = {name for name, _ in iter_safetensors(tiny_llama)}
    assert set(expected) == hf_names
    name = "model.layers.1.self_attn.k_proj.weight"
    shape, dtype = expected[name]
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        model.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(shape))])
    with pytest.raises(ValueError, match="shape mismatch for 'model.layers.1.self_attn.k_proj.weight'"):
        model.load_weights([(name, torch.zeros(shape[0] + 1, shape[1]))])
    before = {n: p.clone() for n, p in model.named_parameters()}
    new = torch.randn(shape, dtype=dtype)
    assert model.load_weights([(name, new)]) == {name}
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.qkv_proj.weight[attn.q_size : attn.q_size + attn.kv_size], new)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"model.layers.1.self_attn.qkv_proj.weight"}


def test_unsupported_architecture_is_a_clear_error(tiny_qwen2):
    config = AutoConfig.from_pretrained(tiny_qwen2)
    config.architectures = ["MambaForCausalLM"]
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(tiny_qwen2, config, torch.float32, torch.device("cpu"))
