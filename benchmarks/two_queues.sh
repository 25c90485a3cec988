#!/usr/bin/env bash
# One device call on a machine of two GPUs, used as two one-GPU machines at once:
#   bash benchmarks/two_queues.sh QUEUE_FILE_0 QUEUE_FILE_1
# Each queue file holds one command per line, "SECONDS LINES COMMAND...", run in order on its own
# GPU (CUDA_VISIBLE_DEVICES=0 or 1) under `timeout SECONDS`, the last LINES non-empty lines of its
# output kept in $OUT/log (all of it in $OUT/q0.log and $OUT/q1.log; commands may write up to
# three files of their own into $OUT beside these and the two kernel caches); blank lines and lines
# starting with # are skipped. The two queues run side by side: timings to compare belong in the
# same queue (one GPU), tests and one-off runs in the other. Installs the carried wheels and
# kernel caches as gpu_session.sh does, and keeps NVLink multicast off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/device_env.sh
T0=$(date +%s)
TMP=$(mktemp -d)  # step files stay out of $OUT: a call brings back at most 8 files
date -u +%Y-%m-%dT%H:%M:%SZ >> "$OUT/log"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader >> "$OUT/log"

run_queue() {  # run_queue GPU FILE
  local gpu=$1 file=$2 t n cmd
  while read -r t n cmd; do
    case "$t" in ""|\#*) continue ;; esac
    local head="== [gpu $gpu $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $cmd"
    echo "$head" >> "$OUT/q$gpu.log"
    CUDA_VISIBLE_DEVICES=$gpu timeout "$t" bash -c "$cmd" < /dev/null > "$TMP/q$gpu.step" 2>&1
    echo "rc=$?" >> "$TMP/q$gpu.step"
    cat "$TMP/q$gpu.step" >> "$OUT/q$gpu.log"
    { echo "$head"; grep -v "^\s*$" "$TMP/q$gpu.step" | tail -n "$n"; } > "$TMP/q$gpu.kept"
    flock "$OUT/log" cat "$TMP/q$gpu.kept" >> "$OUT/log"
  done < "$file"
}

touch "$OUT/log"
run_queue 0 "$1" &
run_queue 1 "$2" &
wait
save_jit_cache
echo "done after $(( $(date +%s) - T0 ))s" | tee -a "$OUT/log"
cat "$OUT/log"
