#!/usr/bin/env bash
# Runs on a machine of two or more GPUs (one device call): bash benchmarks/multi_gpu_session.sh PART...
# Installs the wheels brought in .whl/ (and the compiled kernels in .jit/, see gpu_session.sh),
# keeps NVLink multicast off in every process, then runs each PART in order, each step under its
# own timeout; a short log goes to stdout and $OUT/log, everything to $OUT/full.log and
# $OUT/gpu-tests.log. PARTs: diag (nccl_check in the two-GPU test's layout, then that test alone
# with every process's stacks dumped after 70 s), ncclonly, killed, compat, ncclsync, tptests,
# tpq, tpstacks, real (pytest selections of the two-GPU cases), three (needs three GPUs), latency, tpfwd
# (tp 1 against tp 2), weightsync, remote, pool (two replicas, one GPU each), llama
# (500 x 4096/2048 at tp 1 and tp 2), tpfwd2 (tp 2 alone), tprest (the tp cases not yet run on two GPUs), fusion (FlashInfer's all-reduce
# fusion: the forward, the step, the bf16 tests), pinning and pinning8 (the host backup's first step, threaded pinning in the second). STACKS=N: every process started
# writes its threads' stacks into the log N seconds after it starts (benchmarks/stack_dump).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/device_env.sh
if [ -n "${STACKS:-}" ]; then export DUMP_AFTER_S=$STACKS PYTHONPATH=$PWD/benchmarks/stack_dump:$PYTHONPATH; fi
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
say() { echo "== [$(date -u +%H:%M:%S) +$(elapsed)s] $*" | tee -a $OUT/log; }
step() {  # step TIMEOUT TAIL CMD...
  local t=$1 n=$2; shift 2
  say "$*"
  timeout "$t" "$@" > $OUT/step.tmp 2>&1; echo "rc=$?" >> $OUT/step.tmp
  cat $OUT/step.tmp >> $OUT/full.log
  grep -v "^\s*$" $OUT/step.tmp | tail -n "$n" | tee -a $OUT/log
}
pyt() {  # pyt TIMEOUT PYTEST-ARGS...
  local t=$1; shift
  say "pytest $*"
  timeout $t python3 -m pytest -v -p no:cacheprovider --timeout 200 "$@" > $OUT/t.log 2>&1; echo "rc=$?" >> $OUT/t.log
  cat $OUT/t.log >> $OUT/gpu-tests.log
  grep -E "PASSED|FAILED|ERROR|SKIPPED|rc=|passed|failed" $OUT/t.log | tail -n 20 | tee -a $OUT/log
  grep -E "^E " $OUT/t.log | head -n 20 | tee -a $OUT/log
}
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a $OUT/log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/log
for part in "$@"; do
  case $part in
  diag)
    step 60 12 python3 benchmarks/nccl_check.py --mib 64 --steps 2 --gpus 1 0 --trainer-current-device 0
    say "diag: the NCCL test alone, stacks dumped at 70 s"
    DUMP_AFTER_S=70 NCCL_DEBUG=INFO PYTHONPATH=$PWD/benchmarks/stack_dump:$PYTHONPATH timeout 95 python3 -m pytest -s -v -p no:cacheprovider \
      tests/test_weight_sync_gpu.py -k test_nccl_between_two_gpus > $OUT/diag.log 2>&1; echo "rc=$?" >> $OUT/diag.log
    grep -E "PASSED|FAILED|rc=|Error|error" $OUT/diag.log | tail -n 20 | tee -a $OUT/log ;;
  tpq) pyt 240 -s tests/test_gpu_tensor_parallel.py -k "two_gpus and tiny_qwen3" ;;
  ncclonly) pyt 100 tests/test_weight_sync_gpu.py -k test_nccl_between_two_gpus ;;
  weightsync)
    step 200 6 python3 benchmarks/bench_weight_sync.py --model qwen2.5-7b --paths nccl
    step 200 6 python3 benchmarks/bench_weight_sync.py --model qwen2.5-7b --paths nccl --weight-update-backup auto ;;
  pinning)  # the host backup's first step, with torch's pinned allocator as it is
    step 200 6 python3 benchmarks/bench_weight_sync.py --model qwen2.5-7b --paths nccl --weight-update-backup cpu ;;
  pinning8)  # the same, torch's pinned allocator registering in 8 threads
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
      step 200 6 python3 benchmarks/bench_weight_sync.py --model qwen2.5-7b --paths nccl --weight-update-backup cpu ;;
  tpstacks) pyt 300 -s --timeout 120 tests/test_gpu_tensor_parallel.py -k "two_gpus and tiny_qwen3 and triton" ;;
  tprest) pyt 200 tests/test_gpu_tensor_parallel.py -k "per_rank or (two_gpus and tiny_qwen3 and triton and eager)" ;;
  tptests) pyt 450 tests/test_gpu_tensor_parallel.py -k "two_gpus or per_rank" ;;
  compat) pyt 150 tests/compat/test_sglang_weights_distributed.py -k nccl ;;
  killed) pyt 150 tests/test_weight_sync_gpu.py -k killed ;;
  ncclsync) pyt 150 tests/test_weight_sync_gpu.py -k "nccl and not killed" ;;
  real) pyt 250 tests/test_gpu_real_configs.py -k tp2 ;;
  three) pyt 400 tests/test_gpu_three_gpus.py ;;
  latency)
    step 200 4 python3 benchmarks/bench_latency.py --model qwen2.5-7b
    step 200 4 python3 benchmarks/bench_latency.py --model qwen2.5-7b --tp-size 2 ;;
  tpfwd)
    step 150 2 python3 benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 1
    step 150 2 python3 benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 2
    step 150 2 python3 benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 2 --no-collectives ;;
  fusion)  # enable_flashinfer_allreduce_fusion against the NCCL all-reduce
    step 240 2 python3 benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 2 --enable-flashinfer-allreduce-fusion
    step 200 4 python3 benchmarks/bench_latency.py --model qwen2.5-7b --tp-size 2 --enable-flashinfer-allreduce-fusion
    pyt 250 tests/test_gpu_real_configs.py -k "tp2" ;;
  tpfwd2) step 150 60 python3 benchmarks/bench_tp_forward.py --model qwen2.5-7b --tp-size 2 ;;
  remote) step 200 6 python3 trainers_examples/remote_trainer.py --device cuda:0 --trainer-device cuda:1 --steps 3 ;;
  pool)
    step 300 4 python3 benchmarks/bench_pool.py --model qwen3-0.6b --max-total-tokens 250000 --one-gpu-each --probes 100 ;;
  llama)
    step 260 4 python3 benchmarks/bench_offline.py --model llama-3.1-8b --workload random --num-seqs 500 --input-len 4096 --output-len 2048
    step 200 4 python3 benchmarks/bench_offline.py --model llama-3.1-8b --workload random --num-seqs 500 --input-len 4096 --output-len 2048 --tp-size 2 ;;
  esac
done
save_jit_cache
say done
