"""Weight-sync building blocks, in process: spec checks, transactions, buckets and tensor handles,
stale-KV invalidation, version labels, update-group timeouts."""

from __future__ import annotations

import json
import os
import time
import weakref

import pytest
import torch
from server_helpers import free_port
from transformers import AutoConfig

from rollout.engine.kv_manager import KVManager
from rollout.engine.messages import TokenizedRequest
from rollout.engine.req import Req
from rollout.engine.sampling_params import SamplingParams
from rollout.forward.kv_pool import ReqToTokenPool
from rollout.models.loader import load_model
from rollout.weight_sync.flat_bucket import FlatBucket
from rollout.weight_sync.specs import WeightSpec, build_specs, check_against_model
from rollout.weight_sync.tensor_handles import TensorHandles, open_tensors, share_tensors
from rollout.weight_sync.transaction import HostBuffers, WeightTransaction
from rollout.weight_sync.update_group import UpdateGroup, WeightSyncError
from rollout.weight_sync.versions import VersionLabels


@pytest.fixture(scope="module")
def model(tiny_qwen3):
    return load_model(tiny_qwen3, AutoConfig.from_pretrained(tiny_qwen3), torch.float32, "cpu")


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(model, snap) -> bool:
    return all(torch.equal(p, snap[n]) for n, p in model.named_parameters())


def test_specs_are_checked_as_a_whole_before_loading(model):
    expected = model.hf_param_shapes()
    name = "model.layers.0.self_attn.q_proj.weight"
    shape, dtype = expected[name]
    good = WeightSpec(name, shape, dtype)
    assert check_against_model([good], expected, model.is_ignored_weight) == [good]
    bad = [
        good,
        WeightSpec("model.layers.9.mlp.up_proj.weight", (1,), dtype),
        WeightSpec("model.norm.weight", (3,), dtype),
        WeightSpec("model.embed_tokens.weight", expected["model.embed_tokens.weight"][0], torch.float16),
    ]
    with pytest.raises(ValueError) as err:
        check_against_model(bad, expected, model.is_ignored_weight)
    text = str(err.value)
    assert "unknown weight name" in text and "layers.9" in text
    assert "model.norm.weight must be [64], got [3]" in text
    assert "embed_tokens.weight must be float32, got float16" in text
    # A disk update may carry another floating dtype (the load casts); rotary buffers are skipped.
    fp16 = WeightSpec("model.norm.weight", expected["model.norm.weight"][0], torch.float16)
    rotary = WeightSpec("model.layers.0.self_attn.rotary_emb.inv_freq", (16,), torch.float32)
    assert check_against_model([fp16, rotary], expected, model.is_ignored_weight, exact_dtype=False) == [fp16]
    with pytest.raises(ValueError, match="repeated"):
        build_specs(["a", "a"], ["float32"] * 2, [[1], [1]])
    with pytest.raises(ValueError, match="one entry per tensor"):
        build_specs(["a"], ["float32"], [])
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_specs(["a"], ["float99"], [[1]])


@pytest.mark.parametrize("backup", ["cpu", "device", "auto"])
def test_rollback_restores_every_weight_bitwise(model, backup):
    before = _snapshot(model)
    txn = WeightTransaction(model, backup)
    names = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight", "model.norm.weight"]
    for name in names:
        view = model.hf_weight(name)
        txn.load(name, torch.randn_like(view))
    assert not _same(model, before)
    # Once dropped, no copy on the device is referenced any more: the device's cache is
    # emptied right then, and a copy still held would stay in it. (Host backups are slices of
    # a buffer kept for the next update.)
    device = backup == "device"
    saved, alive = [weakref.ref(t) for t in txn._saved.values()] if device else [], []
    drop = txn._drop_saved
    txn._drop_saved = lambda: (drop(), alive.extend(r for r in saved if r() is not None))
    assert txn.rollback() is True
    assert _same(model, before)
    assert not alive and (saved or not device)


def test_host_backups_of_a_whole_model_share_one_buffer_of_its_size_update_after_update(model):
    # Every weight written, rolled back, twice: the second update reuses the first's copies.
    before = _snapshot(model)
    params = list(model.parameters())
    buffers = HostBuffers(params)
    names = [n for n in model.hf_param_shapes() if not model.is_ignored_weight(n)]
    for _ in range(2):
        txn = WeightTransaction(model, "cpu", buffers)
        for name in names:
            txn.load(name, torch.randn_like(model.hf_weight(name)))
        assert not _same(model, before)
        assert txn.rollback() is True
        assert _same(model, before)
    copies = [buffers.like(n, model.hf_weight(n)) for n in names]
    held = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in copies}
    sizes = [p.numel() * p.element_size() for p in params]
    assert len(held) <= 2  # one buffer; a tied weight's second name may take its own
    assert sum(held.values()) <= sum(sizes) + 4 * HostBuffers.ALIGN * len(params) + max(sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_backup_keeps_old_values_on_the_device_while_it_has_room(tiny_qwen3, monkeypatch):
    import rollout.weight_sync.transaction as transaction

    gpu_model = load_model(tiny_qwen3, AutoConfig.from_pretrained(tiny_qwen3), torch.float32, "cuda")
    before = _snapshot(gpu_model)
    name, other = "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"
    txn = WeightTransaction(gpu_model, "auto")
    txn.load(name, torch.randn_like(gpu_model.hf_weight(name)))
    # No room left (as with a full KV cache): the next backup goes to the host.
    monkeypatch.setattr(transaction, "AUTO_DEVICE_HEADROOM", 1 << 60)
    txn.load(other, torch.randn_like(gpu_model.hf_weight(other)))
    assert txn._saved[name].is_cuda and not txn._saved[other].is_cuda
    assert txn.rollback() is True
    assert _same(gpu_model, before)


class _OneBigWeight(torch.nn.Module):
    """The part of a model a WeightTransaction uses, around one 64 MiB weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1 << 24, device="cuda"), requires_grad=False)

    def hf_weight(self, name: str) -> torch.Tensor:
        return self.weight

    def is_ignored_weight(self, name: str) -> bool:
        return False

    def load_weights(self, weights) -> None:
        for _, tensor in weights:
            self.weight.copy_(tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("finish", ["commit", "rollback"])
def test_a_device_backup_gives_its_memory_back_to_the_device(finish):
    # What needs it next (the KV cache resumed through torch-memory-saver, a trainer on the
    # same GPU) allocates outside torch's cache of free blocks.
    model, new = _OneBigWeight(), torch.ones(1 << 24, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no free block of earlier tests' for the backup to share a segment with
    reserved = torch.cuda.memory_reserved()
    txn = WeightTransaction(model, "device")
    txn.load("weight", new)
    assert torch.cuda.memory_reserved() >= reserved + new.nbytes
    getattr(txn, finish)()
    given_back = torch.cuda.memory_reserved()  # before the checks below allocate
    assert torch.equal(model.weight, new if finish == "commit" else torch.zeros_like(new))
    assert given_back <= reserved


def test_without_backup_a_written_update_reports_what_it_lost(model):
    before = _snapshot(model)
    txn = WeightTransaction(model, None)
    name = "model.layers.1.self_attn.o_proj.weight"
    txn.load(name, torch.zeros_like(model.hf_weight(name)))
    assert txn.unrecoverable() == [name]
    assert txn.rollback() is False
    model.load_weights([(name, before["model.layers.1.self_attn.o_proj.weight"])])
    assert _same(model, before)


def test_commit_keeps_the_loaded_values(model):
    name = "model.layers.0.mlp.down_proj.weight"
    old = model.hf_weight(name).clone()
    new = old + 1
    txn = WeightTransaction(model, "cpu")
    txn.load(name, new)
    assert txn.commit() == [name]
    assert torch.equal(model.hf_weight(name), new)
    model.load_weights([(name, old)])


def test_host_handles_round_trip_through_json_and_free_their_memory():
    named = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.arange(7, dtype=torch.int64)), ("c", torch.randn(2, dtype=torch.bfloat16))]
    sent = share_tensors(named)
    payload = json.loads(json.dumps(sent.handles.to_json()))
    opened = open_tensors(TensorHandles.from_json(payload))
    for (name, want), (got_name, got) in zip(named, opened.named):
        assert name == got_name and torch.equal(want, got)
    opened.close()
    block = payload["buffers"][0]["shm"]
    assert os.path.exists(f"/dev/shm/{block}")
    sent.close()
    assert not os.path.exists(f"/dev/shm/{block}")


def test_a_kept_bucket_is_sent_without_copy_and_keeps_its_block():
    bucket = FlatBucket.pack([("x", torch.ones(4)), ("y", torch.zeros(2, 3, dtype=torch.float16))])
    first = share_tensors(bucket).handles
    bucket.fill([("x", torch.full((4,), 2.0)), ("y", torch.ones(2, 3))])
    second = share_tensors(bucket).handles
    assert first.buffers == second.buffers  # same block: nothing reopened or copied per send
    opened = open_tensors(second)
    assert torch.equal(dict(opened.named)["x"], torch.full((4,), 2.0))
    assert dict(opened.named)["y"].dtype == torch.float16
    opened.close()
    bucket.close()


def test_a_bucket_fill_checks_every_tensor_before_copying_any():
    bucket = FlatBucket.pack([("x", torch.ones(4)), ("y", torch.zeros(2, 3))], shared=False)
    with pytest.raises(ValueError, match=r"y must be \[2, 3\], got \[3, 2\]"):
        bucket.fill([("x", torch.full((4,), 2.0)), ("y", torch.ones(3, 2))])
    with pytest.raises(ValueError, match="exactly the bucket's tensor names"):
        bucket.fill([("x", torch.full((4,), 2.0)), ("z", torch.ones(2, 3))])
    assert torch.equal(dict(bucket.views())["x"], torch.ones(4))  # nothing was copied


class _RecordingEngine:
    """What WeightSender needs of a float32 engine; keeps the blocks and values of each push."""

    def __init__(self) -> None:
        self.pushes: list[tuple[list[str], dict[str, torch.Tensor]]] = []

    def get_server_info(self) -> dict:
        return {"dtype": "float32"}

    def update_weights_from_tensor(self, buckets, load_format=None, weight_version=None) -> dict:
        values = {n: t.clone() for b in buckets for n, t in b.views()}
        self.pushes.append(([b.block.name for b in buckets], values))
        return {"success": True}


def test_a_sender_keeps_its_buckets_while_the_names_and_shapes_repeat():
    from rollout.weight_sync.sender import WeightSender

    engine = _RecordingEngine()
    sender = WeightSender(engine, method="tensor", bucket_bytes=100)  # a bucket or two each
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen) for n, s in [("a", (4, 4)), ("b", (3,)), ("c", (2, 8))]}
    pushes = [
        weights,
        {**weights, "b": torch.randn(3, generator=gen).to(torch.bfloat16)},  # cast to float32
        {**weights, "c": torch.randn(8, 2, generator=gen)},  # a new shape: new buckets
        {"a": weights["a"], "d": weights["b"], "c": weights["c"]},  # a new name: new buckets
    ]
    try:
        for named in pushes:
            sender.push(named)
    finally:
        sender.close()
    blocks = [b for b, _ in engine.pushes]
    assert len(blocks[0]) > 1 and blocks[1] == blocks[0]  # the same blocks: nothing reopened
    assert blocks[2] != blocks[1] and blocks[3] != blocks[2]
    for named, (_, got) in zip(pushes, engine.pushes):
        assert got.keys() == named.keys()
        assert all(torch.equal(got[n], t.float()) for n, t in named.items())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.update(format="pickle"), "format"),
        (lambda p: p["buffers"][0].update(shm="../../etc/passwd"), "shared-memory name"),
        (lambda p: p["tensors"][0].update(offset=1), "do not fit"),
        (lambda p: p["tensors"][0].update(offset=10**9), "do not fit"),
        (lambda p: p["tensors"][0].update(dtype="object"), "dtype"),
        (lambda p: p["tensors"][0].update(shape=[-1]), "shape"),
        (lambda p: p["tensors"][0].update(buffer=5), "does not exist"),
        (lambda p: p["tensors"][0].update(extra=1), "must be"),
        (lambda p: p.update(kind="cuda"), "cuda buffer"),
    ],
)
def test_untrusted_handles_are_refused_field_by_field(mutate, message):
    sent = share_tensors([("w", torch.randn(4, 4))])
    payload = json.loads(json.dumps(sent.handles.to_json()))
    mutate(payload)
    with pytest.raises(ValueError, match=message):
        TensorHandles.from_json(payload)
    sent.close()


def _req(ids: list[int]) -> Req:
    treq = TokenizedRequest(rid=str(ids[:3]), input_ids=ids, params=SamplingParams(), seed=0)
    return Req(req=treq, max_new_tokens=16)


def _prefill(kv: KVManager, req: Req) -> None:
    assert kv.attach(req)
    n = len(req.ids) - req.kv_len
    assert kv.allocate(req, n) is not None
    req.kv_len += n
    kv.insert_computed(req)


def test_kv_from_older_weights_is_never_matched_again():
    kv = KVManager(256, ReqToTokenPool(4, 64, "cpu"), disable_cache=False)
    prompt = list(range(10, 40))
    done, live = _req(prompt), _req(prompt + [1, 2])
    _prefill(kv, done)
    kv.release(done)
    _prefill(kv, live)
    assert live.prefix_len >= len(prompt) - 1  # reused the finished request's KV
    kv.invalidate_cache([live])
    assert kv.usage()["kv_stale"] > 0  # still locked by the live request
    again = _req(prompt)
    assert kv.attach(again) and again.kv_len == 0  # nothing of the old weights matches
    # The live request goes on in place: what it computes is its own, never cached.
    assert kv.allocate(live, 3) is not None
    live.kv_len += 3
    kv.insert_computed(live)
    kv.release(live)
    kv.release(again)
    assert kv.usage()["kv_stale"] == 0 and kv.cache.total_size() == 0
    assert kv.is_whole() and kv.allocator.available() == 256


def test_version_labels_keep_the_last_named_label_for_unnamed_updates():
    labels = VersionLabels()
    assert labels.publish(None) == "default"  # as SGLang: an update without a name keeps it
    assert labels.publish("step-3") == "step-3"
    assert labels.publish(None) == "step-3" == labels.current


def test_joining_a_group_nobody_hosts_fails_within_its_timeout():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="could not join"):
        UpdateGroup.join("127.0.0.1", port, 1, 2, "nobody", "gloo", timeout_s=1.0)
    assert time.monotonic() - start < 10


def test_leaving_an_nccl_group_whose_peers_are_stuck_ends_within_two_timeouts():
    """An NCCL group whose other ranks never leave: its shutdown waits for them, and the abort
    that follows can wait on that shutdown (a trainer hung here on GPUs). Leaving still ends,
    after the shutdown's and the abort's timeouts, and the group is closed."""
    import threading

    stuck = threading.Event()

    class StuckGroup:
        def shutdown(self) -> None:
            stuck.wait(30)

        def abort(self) -> None:
            stuck.wait(30)

    group = UpdateGroup("stuck", "nccl", 0, 2, 0.2, torch.device("cpu"), StuckGroup(), object())
    start = time.monotonic()
    group.close()
    assert time.monotonic() - start < 2 and group.closed
    stuck.set()


def test_a_flattened_bucket_is_one_broadcast_of_every_tensors_bytes():
    """SGLang's flattened_bucket wire format: one uint8 broadcast, tensors back to back with no
    padding (so a float32 may start at an odd byte: it is copied out, not viewed)."""
    from concurrent.futures import ThreadPoolExecutor

    from rollout.weight_sync import distributed_source

    named = [
        ("a", torch.randn(3, dtype=torch.bfloat16)),  # 6 bytes: what follows is unaligned
        ("b", torch.randn(2, 5)),
        ("c", torch.arange(4, dtype=torch.int64)),
    ]
    specs = [WeightSpec(n, tuple(t.shape), t.dtype) for n, t in named]
    units = distributed_source.broadcast_units(specs, "flattened_bucket")
    assert units == [specs]
    wire = distributed_source.flatten([t for _, t in named], torch.device("cpu"))
    assert wire.dtype == torch.uint8 and wire.numel() == sum(s.nbytes for s in specs)
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        engine = pool.submit(UpdateGroup.join, "127.0.0.1", port, 1, 2, "bucket", "gloo", 20)
        trainer = UpdateGroup.join("127.0.0.1", port, 0, 2, "bucket", "gloo", 20)
        engine = engine.result()
        try:
            got = pool.submit(lambda: list(distributed_source.receive(engine, units, "flattened_bucket")))
            distributed_source.send(trainer, named, "flattened_bucket")
            received = got.result(timeout=20)
        finally:
            trainer.close()
            engine.close()
    assert [n for n, _ in received] == ["a", "b", "c"]
    assert all(torch.equal(t, dict(named)[n]) for n, t in received)


@pytest.mark.parametrize(
    "args, message",
    [
        ((b"/tmp/torch-shm-dir-x/manager.sock", b"/some-other-processes-block", 8), "must be torch's"),
        ((b"/run/some.sock", b"/torch_1_2_3", 8), "torch's shm manager"),
    ],
)
def test_allowed_rebuilds_check_their_arguments(args, message):
    """A payload may name torch's rebuild of a shared-memory storage, but only of torch's own
    blocks through torch's own manager: not any shared memory or socket of the host."""
    import io
    import pickle

    from torch.multiprocessing.reductions import rebuild_storage_filename

    from rollout.weight_sync.serialized_tensors import load_named_tensors

    class Storage:
        def __reduce__(self):
            return rebuild_storage_filename, (torch.UntypedStorage, *args)

    buf = io.BytesIO()
    pickle.Pickler(buf).dump([("model.norm.weight", Storage())])
    with pytest.raises(ValueError, match=message):
        load_named_tensors(buf.getvalue(), None)


def test_engine_answers_are_sglangs_tuples_that_still_read_as_the_dict():
    import pickle

    from rollout.weight_sync.results import of

    info = {"success": True, "message": "loaded 3 weights", "weight_version": "v2"}
    success, message, paused = of(info, paused_count=True)  # update_weights_from_disk's shape
    assert (success, message, paused) == (True, "loaded 3 weights", 0)
    result = of(info)
    assert tuple(result) == (True, "loaded 3 weights")
    assert result["weight_version"] == "v2" and "weight_version" in result
    assert {**result} == dict(result) == info == result.info
    assert pickle.loads(pickle.dumps(result)).info == info  # crosses to a Ray pool as itself
