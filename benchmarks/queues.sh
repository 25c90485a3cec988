#!/usr/bin/env bash
# One device call on a machine of several GPUs, used as several smaller machines at once:
#   bash benchmarks/queues.sh QUEUE...        QUEUE is FILE (the GPU of its position: 0, 1, ...)
#                                             or GPUS:FILE (say 1,2,3:FILE for a three-GPU queue)
# Each queue file holds one command per line, "SECONDS LINES COMMAND...", run in order on its own
# GPUs (CUDA_VISIBLE_DEVICES) under `timeout SECONDS`, the last LINES non-empty lines of its output
# kept in $OUT/log (all of it in $OUT/qN.log; commands may write up to 7 - queues files of their own
# into $OUT beside these and the two kernel caches); blank lines and lines starting with # are
# skipped. A command's whole output is kept, so pipe it through no `tail`: a command cut by its
# timeout takes the pipe's output with it. The queues run side by side: timings to compare
# belong in the same queue, tests and one-off runs in the others. Installs the carried wheels
# and kernel caches as gpu_session.sh does, and keeps NVLink multicast off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/device_env.sh
T0=$(date +%s)
TMP=$(mktemp -d)  # step files stay out of $OUT: a call brings back at most 8 files
date -u +%Y-%m-%dT%H:%M:%SZ >> "$OUT/log"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader >> "$OUT/log"

run_queue() {  # run_queue N GPUS FILE
  local q=$1 gpus=$2 file=$3 t n cmd
  while read -r t n cmd; do
    case "$t" in ""|\#*) continue ;; esac
    local head="== [q$q gpu $gpus $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $cmd"
    echo "$head" >> "$OUT/q$q.log"
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "$t" bash -c "$cmd" < /dev/null > "$TMP/q$q.step" 2>&1
    local rc=$?
    { cat "$TMP/q$q.step"; echo "rc=$rc"; } >> "$OUT/q$q.log"
    { echo "$head"; grep -v "^\s*$" "$TMP/q$q.step" | tail -n "$n"; echo "rc=$rc"; } > "$TMP/q$q.kept"
    flock "$OUT/log" cat "$TMP/q$q.kept" >> "$OUT/log"
  done < "$file"
}

touch "$OUT/log"
q=0
for arg in "$@"; do
  case "$arg" in
  *:*) run_queue $q "${arg%%:*}" "${arg#*:}" & ;;
  *) run_queue $q $q "$arg" & ;;
  esac
  q=$((q + 1))
done
wait
save_jit_cache
echo "done after $(( $(date +%s) - T0 ))s" | tee -a "$OUT/log"
cat "$OUT/log"
