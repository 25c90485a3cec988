"""Process lifecycle: startup failures, a dying scheduler, shutdown, a killed caller."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from process_helpers import alive, descendants, still_alive

from rollout import RolloutEngine
from rollout.engine.processes import PRELOAD, start_fork_server, start_process, stop_process
from rollout.engine.tokenizer_manager import EngineDeadError


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_path"):
        RolloutEngine(str(tmp_path / "nope"))


def test_unknown_option_is_a_clear_error(tiny_qwen3):
    with pytest.raises(TypeError, match="unknown engine option"):
        RolloutEngine(tiny_qwen3, not_an_option=1)


def test_broken_checkpoint_fails_startup_with_the_reason(tiny_qwen3, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EngineDeadError, match="failed to start"):
        RolloutEngine(str(broken), device="cpu")


def test_shutdown_stops_every_subprocess(tiny_qwen3):
    engine = RolloutEngine(tiny_qwen3, device="cpu")
    pids = [p.pid for p in engine._procs]
    engine.generate("hello", {"max_new_tokens": 2})
    engine.shutdown()
    assert still_alive(pids, within_s=10) == []
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hello")


def test_the_scheduler_keeps_its_start_up_heap_out_of_collections(tiny_qwen3):
    """The scheduler process's full collections walk only what serving allocates; the caller's
    process (a trainer's) is left as it was."""
    import gc

    caller = gc.get_freeze_count()
    with RolloutEngine(tiny_qwen3, device="cpu") as engine:
        before = engine.get_server_info()["gc_collections_by_generation"]
        engine.generate(input_ids=[[5, 6, 7]] * 64, sampling_params={"max_new_tokens": 8})
        info = engine.get_server_info()
        assert info["heap_frozen_objects"] > 10_000  # torch's, the model's
        assert gc.get_freeze_count() == caller
        # What its collections cost is reported by generation (a benchmark shows the run's share).
        assert len(info["gc_seconds_by_generation"]) == len(before) == 3


def test_a_shutdown_ends_the_calls_in_flight_with_an_error(tiny_qwen3):
    engine = RolloutEngine(tiny_qwen3, device="cpu")
    long = {"max_new_tokens": 3000, "ignore_eos": True}
    results: dict[str, BaseException | None] = {}

    def call(name: str, fn) -> None:
        try:
            fn()
            results[name] = None
        except BaseException as e:  # noqa: BLE001 - what the caller gets is what is tested
            results[name] = e

    calls = {
        "generate": lambda: engine.generate(input_ids=[5, 6, 7], sampling_params=long),
        "stream": lambda: list(engine.generate(input_ids=[5, 6, 8], sampling_params=long, stream=True)),
        "async_generate": lambda: asyncio.run(
            engine.async_generate(input_ids=[5, 6, 9], sampling_params=long)
        ),
    }
    threads = [threading.Thread(target=call, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    assert _wait(lambda: engine.get_server_info()["num_running"] == 3, 30)
    engine.shutdown()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a call in flight never returned"
    for name in calls:
        assert isinstance(results[name], EngineDeadError), (name, results[name])
        assert "shut down" in str(results[name])


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_dead_scheduler_raises_instead_of_hanging(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, device="cpu") as engine:
        os.kill(engine._procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            engine.generate("hello", {"max_new_tokens": 4})
        assert time.monotonic() - start < 15


def test_killed_caller_leaves_no_orphans(tiny_qwen3, tmp_path):
    script = textwrap.dedent(
        f"""
        import json, sys, time
        from rollout import RolloutEngine
        engine = RolloutEngine({tiny_qwen3!r}, device="cpu")
        print(json.dumps([p.pid for p in engine._procs]), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert all(alive(p) for p in pids)
        pids = descendants(proc.pid)  # the engine's processes and their fork server
        proc.kill()
        proc.wait()
        assert still_alive(pids, within_s=10) == []
    finally:
        proc.kill()


def _run_script(path, body: str, timeout: float) -> tuple[subprocess.CompletedProcess, list[int]]:
    path.write_text(textwrap.dedent(body))
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=timeout
    )
    pids = json.loads(done.stdout.splitlines()[0]) if done.stdout.strip() else []
    return done, pids


def test_a_script_that_never_shuts_the_engine_down_still_exits(tiny_qwen3, tmp_path):
    # The children ignore SIGTERM; without the engine's own exit hook, multiprocessing's would
    # terminate and then join them forever.
    done, pids = _run_script(
        tmp_path / "open_engine.py",
        f"""
        import json
        from rollout import RolloutEngine

        if __name__ == "__main__":
            engine = RolloutEngine({tiny_qwen3!r}, device="cpu")
            print(json.dumps([p.pid for p in engine._procs]), flush=True)
            out = engine.generate("hello", {{"max_new_tokens": 2}})
            print(len(out["output_ids"]), flush=True)
        """,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "2"
    assert len(pids) == 2 and still_alive(pids, within_s=10) == []


def test_an_engine_created_outside_the_main_guard_names_the_guard(tiny_qwen3, tmp_path):
    done, _ = _run_script(
        tmp_path / "unguarded.py",
        f"""
        from rollout import RolloutEngine
        engine = RolloutEngine({tiny_qwen3!r}, device="cpu")
        """,
        timeout=120,
    )
    assert done.returncode == 1
    assert "EngineDeadError" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr.splitlines()[-1]


def test_an_interrupted_generate_aborts_its_requests(tiny_qwen3, tmp_path):
    # Ctrl+C while generate() waits: the requests stop running and give their KV back, as when
    # a stream is left or async_generate is cancelled, and the engine serves on.
    done, _ = _run_script(
        tmp_path / "interrupted.py",
        f"""
        import json, os, signal, threading, time
        from rollout import RolloutEngine

        if __name__ == "__main__":
            engine = RolloutEngine({tiny_qwen3!r}, device="cpu")
            print(json.dumps([]), flush=True)
            # Ctrl+C as in a terminal: a suite started in the background by a shell without
            # job control hands its processes SIGINT ignored.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            params = {{"max_new_tokens": 4000, "ignore_eos": True}}
            try:
                engine.generate(input_ids=[[1, 2, i] for i in range(16)], sampling_params=params)
                print("not interrupted", flush=True)
            except KeyboardInterrupt:
                pass
            deadline = time.monotonic() + 3  # the requests would run for tens of seconds
            while time.monotonic() < deadline:
                info = engine.get_server_info()
                if info["num_running"] == 0 and info["kv_in_requests"] == 0:
                    break
                time.sleep(0.1)
            out = engine.generate(input_ids=[1, 2, 3], sampling_params={{"max_new_tokens": 2}})
            print(json.dumps([info["num_running"], info["kv_in_requests"], len(out["output_ids"])]))
            engine.shutdown()
        """,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [0, 0, 2]


def _write_environment(path: str) -> None:
    with open(path, "w") as f:
        json.dump(dict(os.environ), f)


def test_a_child_gets_the_environment_of_the_moment_it_is_started(tmp_path, monkeypatch):
    # The fork server keeps the environment it started with; each child must see the engine's
    # as it is when the engine starts (CUDA_VISIBLE_DEVICES, NCCL settings, a trainer's own).
    start_fork_server()
    monkeypatch.setenv("ROLLOUT_TEST_SET_LATER", "yes")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    path = str(tmp_path / "environ.json")
    proc = start_process(_write_environment, (path,), "environment")
    stop_process(proc, timeout=30)
    with open(path) as f:
        environ = json.load(f)
    assert environ == dict(os.environ)
    assert environ["ROLLOUT_TEST_SET_LATER"] == "yes" and "OMP_NUM_THREADS" not in environ


def test_the_fork_server_imports_touch_no_cuda():
    # A process that initialized CUDA cannot fork children that use it: what the fork server
    # preloads must not ask torch about GPUs at import.
    script = textwrap.dedent(
        """
        import importlib, torch

        def touched(*args, **kwargs):
            raise RuntimeError("CUDA touched at import")

        for name in ("is_available", "device_count", "init", "_lazy_init", "current_device"):
            setattr(torch.cuda, name, touched)
        torch._C._cuda_getDeviceCount = touched
        from rollout.engine.processes import PRELOAD
        for module in PRELOAD:
            importlib.import_module(module)
        print("imported", len(PRELOAD))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["imported", str(len(PRELOAD))]
