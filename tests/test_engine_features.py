"""Engine behaviour users rely on: prefix reuse, seeds, stop strings, streaming, retraction,
aborts, bad inputs. One engine per module (CPU, float32, tiny model)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from rollout import RolloutEngine

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    with RolloutEngine(tiny_qwen2, dtype="float32", device="cpu", max_total_tokens=4096) as eng:
        yield eng


def _ids(seed: int, n: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _assert_pool_whole(engine) -> None:
    info = engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["kv_whole"], info
    assert engine.flush_cache()["success"]
    info = engine.get_server_info()
    assert info["kv_free"] == info["kv_total"], info


def test_shared_prefix_is_reused(engine):
    prefix = _ids(1, 200)
    first = engine.generate(input_ids=prefix + _ids(2, 5), sampling_params=GREEDY)
    second = engine.generate(input_ids=prefix + _ids(3, 7), sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] < 190
    assert second["meta_info"]["cached_tokens"] >= 190


def test_n_samples_prefill_the_prompt_once(engine):
    engine.flush_cache()
    prompt = _ids(4, 120)
    outs = engine.generate(input_ids=prompt, sampling_params={"n": 8, "max_new_tokens": 8, "seed": 3})
    assert len(outs) == 8
    cached = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and all(c == len(prompt) - 1 for c in cached[1:])
    # Different seeds per sample: not all identical.
    assert len({tuple(o["output_ids"]) for o in outs}) > 1


def test_seeded_sampling_is_independent_of_the_batch(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 12, "seed": 1234}
    prompt = _ids(5, 30)
    alone = engine.generate(input_ids=prompt, sampling_params=params)
    others = [_ids(6, 50), _ids(7, 9), _ids(8, 70)]
    batch = engine.generate(
        input_ids=[others[0], prompt, others[1], others[2]],
        sampling_params=[{"temperature": 0.7, "max_new_tokens": 20}, params, GREEDY, {"seed": 9}],
    )
    assert batch[1]["output_ids"] == alone["output_ids"]
    again = engine.generate(input_ids=prompt, sampling_params=params)
    assert again["output_ids"] == alone["output_ids"]


def test_stop_strings_end_the_text_exactly(engine):
    prompt = "The quick brown fox jumps over the lazy dog"
    full = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    text = full["text"]
    assert len(text) > 10
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, "stop": [stop]})
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, "stop": stop, "no_stop_trim": True}
    )
    assert kept["text"].startswith(text[: text.index(stop)] + stop)


def test_stop_token_ids(engine):
    full = engine.generate(input_ids=_ids(9, 20), sampling_params=GREEDY)
    stop_id = full["output_ids"][5]
    first = full["output_ids"].index(stop_id)
    out = engine.generate(input_ids=_ids(9, 20), sampling_params={**GREEDY, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == full["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_streamed_deltas_join_to_the_full_text(engine):
    prompt = "Once upon a time"
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True, "stop": ["zz"]}
    whole = engine.generate(prompt, params)
    chunks = list(engine.generate(prompt, params, stream=True))
    assert len(chunks) > 1
    joined = ""
    for chunk in chunks:
        assert chunk["text"].startswith(joined)  # each chunk extends the previous one
        joined = chunk["text"]
    assert joined == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def _check_merged_stream(outs: list[dict], want: dict) -> None:
    assert len(outs) < 200, len(outs)  # one output an update would be 401
    for out in outs:  # each output is whole: its entries cover its tokens so far
        meta = out["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == len(out["output_ids"])
    assert outs[-1]["output_ids"] == want["output_ids"]
    got, full = outs[-1]["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in got] == want["output_ids"]
    assert [e[0] for e in got] == pytest.approx([e[0] for e in full], abs=1e-4)


def test_a_stream_read_slowly_gets_its_updates_merged(engine):
    kw = {"input_ids": _ids(40, 5), "return_logprob": True, "top_logprobs_num": 4,
          "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}  # fmt: skip
    want = engine.generate(**kw)
    stream = engine.generate(**kw, stream=True)
    outs = [next(stream)]
    time.sleep(2)  # a slow reader: the updates made meanwhile come as fewer, larger outputs
    _check_merged_stream(outs + list(stream), want)

    async def read_slowly() -> list[dict]:
        outs = []
        async for out in await engine.async_generate(**kw, stream=True):
            if not outs:
                await asyncio.sleep(2)
            outs.append(out)
        return outs

    _check_merged_stream(asyncio.run(read_slowly()), want)


def test_min_new_tokens_and_max_new_tokens_zero(engine):
    out = engine.generate(input_ids=_ids(10, 10), sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    out = engine.generate(
        input_ids=_ids(10, 10), sampling_params={"max_new_tokens": 6, "min_new_tokens": 6, "temperature": 0}
    )
    assert len(out["output_ids"]) == 6


def test_hidden_states(engine):
    out = engine.generate(input_ids=_ids(11, 10), sampling_params=GREEDY, return_hidden_states=True)
    hs = out["meta_info"]["hidden_states"]
    assert len(hs) == len(out["output_ids"]) and len(hs[0]) == 64


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": ""}, "empty"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1, 2, 10**7]}, "token ids must be in"),
        ({"input_ids": [-1, 2]}, "token ids must be in"),
        ({"input_ids": [5] * 5000}, "context"),
        ({"prompt": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"n": 0}}, "n"),
        ({"prompt": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"prompt": "hi", "input_ids": [1]}, "exactly one"),
        ({"prompt": 5}, "prompt must be"),
        ({"prompt": "hi", "logprob_start_len": 50, "return_logprob": True}, "logprob_start_len"),
        ({"prompt": "hi", "logprob_start_len": -2, "return_logprob": True}, "logprob_start_len must be -1"),
    ],
)
def test_bad_input_raises_clear_error_and_engine_keeps_serving(engine, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        engine.generate(**kwargs)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2


def test_concurrent_requests_with_random_aborts_leave_the_pool_whole(engine):
    async def run() -> list:
        rng = random.Random(0)

        async def one(i: int):
            return await engine.async_generate(
                input_ids=_ids(100 + i, rng.randint(5, 60)),
                sampling_params={"max_new_tokens": rng.randint(5, 40), "ignore_eos": True},
            )

        tasks = [asyncio.ensure_future(one(i)) for i in range(64)]
        await asyncio.sleep(0.5)
        doomed = rng.sample(range(64), 20)
        for i in doomed:
            tasks[i].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [(i in doomed, r) for i, r in enumerate(results)]

    results = asyncio.run(run())
    for was_cancelled, result in results:
        if not was_cancelled:
            assert isinstance(result, dict), result
            assert result["meta_info"]["finish_reason"]["type"] == "length"
    _assert_pool_whole(engine)


def test_code_on_the_engines_own_loop_awaits_it_and_is_refused_blocking_calls(engine):
    # rollout serve runs its HTTP server there (run_on_loop): requests reach the engine with
    # no hop between threads; a blocking call there would wait for the loop it holds.
    prompt, endless = _ids(7, 9), {"max_new_tokens": 3000, "ignore_eos": True}

    async def on_loop() -> tuple[dict, list[dict], list[dict]]:
        whole = await engine.async_generate(input_ids=prompt, sampling_params=GREEDY)
        streamed = await engine.async_generate(input_ids=prompt, sampling_params=GREEDY, stream=True)
        chunks = [chunk async for chunk in streamed]
        samples = await engine.async_generate(
            input_ids=[prompt, _ids(8, 5)], sampling_params=GREEDY, stream=True
        )
        merged = [chunk async for chunk in samples]
        left = await engine.async_generate(input_ids=_ids(9, 9), sampling_params=endless, stream=True)
        async for _ in left:
            break
        await left.aclose()  # a stream left early aborts its request
        for blocking in (engine.get_server_info, lambda: engine.generate(input_ids=prompt)):
            with pytest.raises(RuntimeError, match="await its async_ variant, or call it from a thread"):
                blocking()
        return whole, chunks, merged

    whole, chunks, merged = engine.run_on_loop(on_loop())
    assert whole["output_ids"] == engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert [c for c in merged if c["index"] == 0][-1]["output_ids"] == whole["output_ids"]
    _assert_pool_whole(engine)


def test_abort_request_by_rid(engine):
    async def run():
        task = asyncio.ensure_future(
            engine.async_generate(input_ids=_ids(12, 10), sampling_params={"max_new_tokens": 3000, "ignore_eos": True}, rid="victim")
        )
        await asyncio.sleep(1.0)
        engine.abort_request("victim")
        return await asyncio.wait_for(task, timeout=30)

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    _assert_pool_whole(engine)


def test_abort_request_by_the_rid_of_an_n_sample_request_aborts_every_sample(engine):
    params = {"n": 3, "max_new_tokens": 3000, "ignore_eos": True}

    async def run():
        group = asyncio.ensure_future(engine.async_generate(input_ids=_ids(13, 10), sampling_params=params, rid="grp"))
        other = asyncio.ensure_future(
            engine.async_generate(input_ids=_ids(14, 10), sampling_params={**params, "n": 1, "max_new_tokens": 40}, rid="grp-x")
        )
        await asyncio.sleep(1.0)
        engine.abort_request("grp")
        return await asyncio.wait_for(group, timeout=30), await asyncio.wait_for(other, timeout=60)

    samples, other = asyncio.run(run())
    assert [s["meta_info"]["id"] for s in samples] == ["grp-0", "grp-1", "grp-2"]
    assert [s["meta_info"]["finish_reason"]["type"] for s in samples] == ["abort"] * 3
    assert other["meta_info"]["finish_reason"]["type"] == "length"  # another rid is left alone
    _assert_pool_whole(engine)


def test_small_kv_pool_retracts_and_still_matches(tiny_qwen2):
    prompts = [_ids(200 + i, 40 + 7 * i) for i in range(8)]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with RolloutEngine(tiny_qwen2, dtype="float32", device="cpu") as big:
        expected = [o["output_ids"] for o in big.generate(input_ids=prompts, sampling_params=params)]
    with RolloutEngine(tiny_qwen2, dtype="float32", device="cpu", max_total_tokens=200) as small:
        got = [o["output_ids"] for o in small.generate(input_ids=prompts, sampling_params=params)]
        info = small.get_server_info()
    assert got == expected
    assert info["retractions"] > 0
    assert info["kv_whole"]


def test_admission_estimates_future_tokens_and_retracts_less(tiny_qwen2):
    # Admission keeps KV free for what running requests are still to generate (SGLang's
    # new-token ratio): fewer retractions, so less prefill redone, and the same outputs.
    prompts = [_ids(300 + i, 30 + 5 * i) for i in range(12)]
    params = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
    runs = {}
    for conservativeness in (0.0, 1.0):  # 0: reserve nothing, admit whatever fits now
        with RolloutEngine(
            tiny_qwen2, dtype="float32", device="cpu", max_total_tokens=300,
            schedule_conservativeness=conservativeness,
        ) as engine:  # fmt: skip
            outs = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            info = engine.get_server_info()
        assert info["kv_whole"]
        runs[conservativeness] = (outs, info["retractions"])
    assert runs[1.0][0] == runs[0.0][0]
    assert runs[1.0][1] < runs[0.0][1], runs
    with pytest.raises(ValueError, match="schedule_conservativeness must be >= 0"):
        RolloutEngine(tiny_qwen2, device="cpu", schedule_conservativeness=-1)


def test_an_fp8_kv_cache_serves_with_logprobs_near_the_full_cache(tiny_qwen2, engine):
    # kv_cache_dtype="fp8_e4m3" stores keys and values in one byte each: the engine reports it,
    # serves the same requests, and its logprobs of the full cache's tokens stay close.
    prompts = [_ids(400 + i, 20 + 9 * i) for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    full = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    with RolloutEngine(tiny_qwen2, dtype="float32", device="cpu", max_total_tokens=4096, kv_cache_dtype="fp8_e4m3") as fp8:
        info = fp8.get_server_info()
        scored = fp8.generate(
            input_ids=[p + o["output_ids"] for p, o in zip(prompts, full)],
            sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0,
        )
        _assert_pool_whole(fp8)
    assert info["kv_cache_dtype"] == "float8_e4m3fn" and info["dtype"] == "float32"
    for p, o, s in zip(prompts, full, scored):
        want = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        got = [lp for lp, _, _ in s["meta_info"]["input_token_logprobs"][len(p) :]]
        assert len(got) == len(want)
        # 3 mantissa bits move a tiny random model's logprobs by ~0.1 (at most 0.53 here);
        # reading the wrong slots or values would move them by nats. The exact check of the
        # rounding is in tests/kernels/test_kernels_triton_backend.py.
        diffs = [abs(a - b) for a, b in zip(got, want)]
        assert sum(diffs) / len(diffs) < 0.15 and max(diffs) < 1.0, diffs
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, fp8_e5m2, got 'int8'"):
        RolloutEngine(tiny_qwen2, device="cpu", kv_cache_dtype="int8")
