#!/usr/bin/env bash
# One device call: install the wheels brought along, run the GPU tests, then the benchmarks.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh [SPEC...]
# Each SPEC is a benchmark name and its arguments, e.g.
#   "latency --model qwen2.5-7b --compare hf"   -> python benchmarks/bench_latency.py ...
#   "offline --model qwen3-0.6b --workload nano" -> python benchmarks/bench_offline.py ...
# FlashInfer compiles its kernels on first use (minutes), Triton its own (seconds each, in every
# process of a fresh machine). The compiled kernels are saved to $OUT/flashinfer-jit.tgz and
# $OUT/triton-cache.tgz; carry them as .jit/ files of the same names to skip compiling next time
# (commands run after this script: export TRITON_CACHE_DIR=/tmp/triton-cache to use the cache).
# GPU_TESTS (default: the GPU test files) and TEST_TIMEOUT pick what pytest runs; GPU_TESTS=none skips it.
set -uo pipefail
source benchmarks/device_env.sh
date -u +%Y-%m-%dT%H:%MZ
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, flashinfer; print('torch', torch.__version__, 'transformers', transformers.__version__, 'flashinfer', flashinfer.__version__)"
# The GPU tests: the files with CUDA cases. Each test may take PER_TEST_TIMEOUT seconds (a fresh
# machine compiles FlashInfer modules for the tiny checkpoints' head dims in the first ones);
# the verbose log goes to $OUT/gpu-tests.log.
GPU_TESTS=${GPU_TESTS:-tests/test_gpu_engine.py tests/test_gpu_fast_path.py tests/test_gpu_lora.py \
  tests/test_gpu_lora_sync.py tests/kernels tests/test_sampler.py tests/test_sampling_edges.py \
  tests/test_logit_bias.py tests/test_deterministic_inference.py tests/test_parity_model.py \
  tests/test_control_no_stall.py tests/test_weight_sync_gpu.py tests/test_weight_group_join.py \
  tests/test_req_to_token.py tests/test_gpu_warm_up.py tests/test_gpu_grammar.py}
if [ "$GPU_TESTS" != none ]; then
  SECONDS=0
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -v -p no:cacheprovider --durations=15 \
    --timeout "${PER_TEST_TIMEOUT:-240}" $GPU_TESTS > "$OUT/gpu-tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/gpu-tests.log" | grep -v PASSED | tail -n 30
  tail -n 20 "$OUT/gpu-tests.log"
  echo "GPU tests took ${SECONDS}s"
fi
save_jit_cache
# MPS=1: CUDA MPS for the benchmarks, so that processes sharing the GPU (bench_pool's workers)
# run their kernels side by side instead of taking turns.
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
fi
for spec in "$@"; do
  set -- $spec
  name=$1
  shift
  echo "== $(date -u +%H:%M:%S) bench_$name $*"
  timeout "${BENCH_TIMEOUT:-300}" python3 "benchmarks/bench_$name.py" "$@" 2>&1 | grep -v "^\s*$" | tail -n 8 | tee -a "$OUT/bench.jsonl"
done
save_jit_cache
if [ "${MPS:-0}" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
