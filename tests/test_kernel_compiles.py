"""The count of Triton kernel variants a process built, which get_server_info reports so that a
benchmark can tell whether anything compiled inside what it timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout.engine.kernel_compiles import KernelCompiles

knobs = pytest.importorskip("triton").knobs


def _triton_asks(name: str) -> bool:
    """What Triton's runtime does when kernel `name` needs a variant it has not built."""
    fn = SimpleNamespace(module="m", name=name, jit_function=None)
    return knobs.runtime.jit_cache_hook(
        key="k", repr=name, fn=fn, compile={}, is_manual_warmup=False, already_compiled=False
    )


def test_variants_are_counted_by_kernel_and_a_hook_already_there_still_decides(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["fn"].name))
    compiles = KernelCompiles().install()
    assert compiles.install() is compiles  # once: not wrapped twice
    for name in ("_rmsnorm_kernel", "_sample_kernel", "_rmsnorm_kernel"):
        assert _triton_asks(name) is False  # the variant is built as usual
    assert compiles.info() == {
        "kernel_compiles": 3,
        "kernel_compiles_by_kernel": {"_rmsnorm_kernel": 2, "_sample_kernel": 1},
    }
    assert seen == ["_rmsnorm_kernel", "_sample_kernel", "_rmsnorm_kernel"]
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: True)  # "skip compiling"
    assert KernelCompiles().install() and _triton_asks("_decode_split_kernel") is True


def test_the_engine_reports_what_its_process_compiled(tiny_qwen3):
    from rollout import RolloutEngine

    with RolloutEngine(tiny_qwen3, device="cpu", dtype="float32", max_total_tokens=512) as engine:
        engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        info = engine.get_server_info()
    assert info["kernel_compiles"] == 0  # the torch backend on the host compiles nothing
    assert info["kernel_compiles_by_kernel"] == {}
