"""attention_backend="triton" against the torch backend on the tiny checkpoints, float32: the
same greedy tokens and near-identical logits, through chunked prefill over a cached prefix and
batched decode of requests of different lengths.

On CPU the kernels are interpreted (see conftest.py), so this drives the models directly with
hand-built ForwardBatches rather than through an engine (whose backend choice rightly refuses
Triton without a GPU); the GPU tests run the whole engine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

pytest.importorskip("triton")

from rollout.forward.attention import (  # noqa: E402
    AttentionShape,
    DecodeChoice,
    create_attention_backend,
)
from rollout.forward.attention.deterministic_backend import DeterministicAttentionBackend  # noqa: E402
from rollout.forward.attention.hybrid_backend import HybridAttentionBackend  # noqa: E402
from rollout.forward.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from rollout.forward.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from rollout.forward.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from rollout.forward.kv_pool import KVPool, to_kv_dtype  # noqa: E402
from rollout.models.layers import use_fused_kernels  # noqa: E402
from rollout.models.llama import head_dim_of  # noqa: E402
from rollout.models.loader import load_model  # noqa: E402

NEW_TOKENS = 4  # the 62-token prompt decodes past 64 keys: two split-KV pieces
CHUNK = 24  # prefill chunk: the longer prompts extend over a cached prefix
PROMPT_LENS = [5, 62, 1, 33]


def _shape(cfg, device: str) -> AttentionShape:
    head_dim = head_dim_of(cfg)
    return AttentionShape(
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
        scaling=head_dim**-0.5, dtype=torch.float32, device=torch.device(device),
        # Graph-style decode splits by this length (4 pieces): some of them empty here.
        max_batch_size=8, max_context_len=256,
    )


class _Driver:
    """Runs requests through a model by hand: the scheduler's bookkeeping, minus the policy."""

    def __init__(
        self, model, cfg, backend, prompts: list[list[int]], device: str, kv_dtype: torch.dtype = torch.float32
    ) -> None:
        gen = torch.Generator().manual_seed(0)
        self.model, self.backend, self.device = model, backend, device
        kv_heads, head_dim = cfg.num_key_value_heads, head_dim_of(cfg)
        self.pool = KVPool(cfg.num_hidden_layers, 512, kv_heads, head_dim, kv_dtype, device)
        self.free = (torch.randperm(511, generator=gen) + 1).tolist()  # scattered, never slot 0
        self.table = torch.zeros(len(prompts) + 3, 128, dtype=torch.int64, device=device)
        self.rows = [len(prompts) + 2 - i for i in range(len(prompts))]  # row != batch index
        self.seqs = [list(p) for p in prompts]
        self.kv_len = [0] * len(prompts)
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.logits: list[torch.Tensor] = []  # [V] of every sampled position

    def _put(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def batch(self, mode: ForwardMode, ext: list[int]) -> tuple[ForwardBatch, list[int]]:
        """Allocates slots for the next ext[i] tokens of each request with ext[i] > 0."""
        idx = [i for i, e in enumerate(ext) if e > 0]
        ids, pos, locs = [], [], []
        for i in idx:
            slots = [self.free.pop() for _ in range(ext[i])]
            self.table[self.rows[i], self.kv_len[i] : self.kv_len[i] + ext[i]] = torch.tensor(slots)
            ids += self.seqs[i][self.kv_len[i] : self.kv_len[i] + ext[i]]
            pos += range(self.kv_len[i], self.kv_len[i] + ext[i])
            locs += slots
        seq_lens = [self.kv_len[i] + ext[i] for i in idx]
        fb = ForwardBatch(
            mode=mode, input_ids=self._put(ids), positions=self._put(pos),
            out_cache_loc=self._put(locs), req_pool_indices=self._put([self.rows[i] for i in idx]),
            seq_lens=self._put(seq_lens), extend_lens=self._put([ext[i] for i in idx]),
            req_to_token=self.table, kv_pool=self.pool, attn_backend=self.backend,
            seq_lens_cpu=seq_lens, extend_lens_cpu=[ext[i] for i in idx],
        )
        return fb, idx

    def step(self, mode: ForwardMode, ext: list[int]) -> None:
        fb, idx = self.batch(mode, ext)
        self.backend.prepare(fb)
        with torch.inference_mode():
            hidden = self.model(fb.input_ids, fb.positions, fb)
        self.finish(hidden, fb, idx, ext)

    def finish(self, hidden: torch.Tensor, fb: ForwardBatch, idx: list[int], ext: list[int]) -> None:
        last = torch.tensor([ext[i] for i in idx]).cumsum(0) - 1
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[last.to(self.device)])
        for row, i in enumerate(idx):
            self.kv_len[i] += ext[i]
            if self.kv_len[i] == len(self.seqs[i]):  # the prompt is done, or a decode step: sample
                token = int(logits[row].argmax())
                self.seqs[i].append(token)
                self.outputs[i].append(token)
                self.logits.append(logits[row].cpu())

    def prefill(self) -> None:
        prompt_lens = [len(s) for s in self.seqs]
        while any(k < n for k, n in zip(self.kv_len, prompt_lens)):
            self.step(ForwardMode.EXTEND, [max(0, min(CHUNK, n - k)) for k, n in zip(self.kv_len, prompt_lens)])

    def decode_padded(self, padded: int) -> None:
        """A decode step as CudaGraphRunner replays one (without the graph): the batch padded
        to `padded` rows of token 0 at slot 0, the backend fed through prepare_graph."""
        fb, idx = self.batch(ForwardMode.DECODE, [1] * len(self.seqs))
        pad = padded - fb.batch_size
        zeros = torch.zeros(pad, dtype=torch.int64, device=self.device)
        static = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=torch.cat([fb.input_ids, zeros]),
            positions=torch.cat([fb.positions, zeros]), out_cache_loc=torch.cat([fb.out_cache_loc, zeros]),
            req_pool_indices=torch.zeros(padded, dtype=torch.int64, device=self.device),
            seq_lens=torch.ones(padded, dtype=torch.int64, device=self.device),
            extend_lens=torch.ones(padded, dtype=torch.int64, device=self.device),
            req_to_token=self.table, kv_pool=self.pool, attn_backend=self.backend,
            seq_lens_cpu=[1] * padded, extend_lens_cpu=[1] * padded,
        )
        self.backend.prepare_graph(padded, fb)
        with torch.inference_mode():
            hidden = self.model(static.input_ids, static.positions, static)
        assert torch.isfinite(hidden).all()  # padding rows included: they write KV slot 0
        self.finish(hidden[: fb.batch_size], fb, idx, [1] * len(self.seqs))


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3"])
def model_setup(request, device):
    path = request.getfixturevalue(request.param)
    cfg = AutoConfig.from_pretrained(path)
    model = load_model(path, cfg, torch.float32, torch.device(device), "auto")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return model, cfg, prompts


def _run(
    model_setup, device: str, backend_name: str, padded: int | None = None, fused: bool = False,
    decode: str | DecodeChoice | None = None, skinny_rows: int = 0, kv_dtype: torch.dtype = torch.float32,
    round_kv_to: torch.dtype | None = None,
) -> _Driver:
    model, cfg, prompts = model_setup
    backend = create_attention_backend(backend_name, _shape(cfg, device), decode)
    driver = _Driver(model, cfg, backend, prompts, device, kv_dtype)
    if round_kv_to is not None:  # a float32 pool holding values rounded as an 8-bit pool holds them
        store = driver.pool.store
        driver.pool.store = lambda layer, loc, k, v: store(
            layer, loc, to_kv_dtype(k, round_kv_to).float(), to_kv_dtype(v, round_kv_to).float()
        )
    # Every linear layer of the tiny checkpoints on the skinny kernel, however small its weight.
    use_fused_kernels(model, fused, skinny_rows, skinny_min_weight=0)
    try:
        driver.prefill()
        for _ in range(NEW_TOKENS - 1):
            if padded is None:
                driver.step(ForwardMode.DECODE, [1] * len(prompts))
            else:
                driver.decode_padded(padded)
    finally:
        use_fused_kernels(model, False)
    return driver


@pytest.fixture(scope="module")
def runs(model_setup, device) -> dict[str, _Driver]:
    return {
        "torch": _run(model_setup, device, "torch"),
        "triton": _run(model_setup, device, "triton"),
        "triton-padded": _run(model_setup, device, "triton", padded=len(PROMPT_LENS) + 3),
        # What an engine on a GPU runs: the fused norm/rotary/SiLU kernels in every layer.
        "triton-fused": _run(model_setup, device, "triton", fused=True),
        # And the skinny GEMM in every linear layer of a decode (4 rows; the prefill's
        # longer chunks keep torch's GEMM).
        "triton-fused-skinny": _run(model_setup, device, "triton", fused=True, skinny_rows=4),
        # decode_attention_backend: extend on one backend, decode on another, one KV pool.
        "torch-then-triton": _run(model_setup, device, "torch", padded=len(PROMPT_LENS) + 3, decode="triton"),
        # large_decode_min_batch: decode batches from a size on through the unsplit kernel
        # (large_decode_piece_keys 0), eager (the 4-row batches) and as a graph replays them
        # (padded to 7 rows); or the Triton decode kernel in pieces of 8 keys (the 33- and
        # 62-token prompts in several), which launches a graph's split count eagerly too.
        "torch-then-unsplit": _run(model_setup, device, "torch", decode=DecodeChoice("torch", None, 4)),
        "torch-then-unsplit-padded": _run(
            model_setup, device, "torch", padded=len(PROMPT_LENS) + 3, decode=DecodeChoice("torch", None, 5)
        ),
        "torch-then-pieces-padded": _run(
            model_setup, device, "torch", padded=len(PROMPT_LENS) + 3, decode=DecodeChoice("torch", None, 5, 8)
        ),
        # kv_cache_dtype="fp8_e4m3": an 8-bit cache, written and read by the torch backend and
        # (on CUDA: the interpreter's 8-bit conversions are wrong) by the fused Triton kernels.
        "torch-fp8": _run(model_setup, device, "torch", kv_dtype=torch.float8_e4m3fn),
        "torch-rounded-kv": _run(model_setup, device, "torch", round_kv_to=torch.float8_e4m3fn),
        **(
            {"triton-fused-fp8": _run(model_setup, device, "triton", fused=True, kv_dtype=torch.float8_e4m3fn)}
            if torch.device(device).type == "cuda"
            else {}
        ),
    }


def _assert_same_run(got: _Driver, want: _Driver, tol: float) -> None:
    """The same greedy tokens, and logits of every sampled position within `tol`."""
    assert got.outputs == want.outputs
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=tol, rtol=tol)


def test_triton_backend_greedy_equals_torch_backend(runs):
    want, got = runs["torch"], runs["triton"]
    assert isinstance(got.backend, TritonAttentionBackend)
    assert all(len(o) == NEW_TOKENS for o in got.outputs)
    _assert_same_run(got, want, 1e-4)


def test_graph_style_padded_decode_equals_eager(runs):
    # CUDA-graph replay feeds the backend through prepare_graph, with padding rows and the
    # split count of the longest context; on CPU the same path runs without the graph.
    want, got = runs["triton"], runs["triton-padded"]
    _assert_same_run(got, want, 1e-5)


def test_fused_layer_kernels_equal_the_torch_layers(runs):
    # RMSNorm (with the residual add and Qwen3's per-head q/k norm read in place), rotary on
    # the qkv views and SiLU-and-mul, in every layer, against the torch path of the same model.
    want, got = runs["torch"], runs["triton-fused"]
    _assert_same_run(got, want, 1e-4)


def test_decode_on_another_backend_than_extend(runs):
    # Extend through the torch backend, then graph-style padded decode through the Triton
    # kernel over the KV the torch backend stored: the tokens of either backend alone.
    want, got = runs["torch"], runs["torch-then-triton"]
    assert isinstance(got.backend, HybridAttentionBackend)
    assert isinstance(got.backend.extend, TorchAttentionBackend)
    assert isinstance(got.backend.decode, TritonAttentionBackend)
    assert got.backend.supports_cuda_graph
    _assert_same_run(got, want, 1e-4)


@pytest.mark.parametrize("run", ["torch-then-unsplit", "torch-then-unsplit-padded"])
def test_large_decode_batches_on_the_unsplit_kernel(runs, run):
    got = runs[run]
    assert isinstance(got.backend.large, DeterministicAttentionBackend)
    assert got.backend.large.seq_lens is not None  # the decode steps were the unsplit kernel's
    _assert_same_run(got, runs["torch"], 1e-4)


def test_large_decode_batches_on_the_triton_kernel_in_long_pieces(runs):
    got = runs["torch-then-pieces-padded"]
    large = got.backend.large
    assert isinstance(large, TritonAttentionBackend) and large.decode_piece_keys == 8
    assert large.seq_lens is not None  # the decode steps were its
    assert large.num_splits > 1  # and cut the requests (a piece per 8 keys)
    _assert_same_run(got, runs["torch"], 1e-4)


def test_an_fp8_kv_cache_changes_only_the_rounding_of_keys_and_values(runs):
    # One byte per element, and the run of a float32 cache holding the same rounded values.
    assert runs["torch-fp8"].pool.k[0].dtype == torch.float8_e4m3fn
    assert runs["torch-fp8"].pool.nbytes * 4 == runs["torch"].pool.nbytes
    _assert_same_run(runs["torch-fp8"], runs["torch-rounded-kv"], 1e-5)


def test_triton_kernels_write_and_read_the_fp8_cache_as_torch_does(runs, device):
    if torch.device(device).type != "cuda":
        pytest.skip("Triton's interpreter converts to 8-bit floats wrongly (-7.875 -> -4); runs on CUDA")
    _assert_same_run(runs["triton-fused-fp8"], runs["torch-fp8"], 1e-4)


def test_skinny_gemm_in_the_linear_layers_equals_the_torch_layers(runs):
    want, got = runs["torch"], runs["triton-fused-skinny"]
    _assert_same_run(got, want, 1e-4)
