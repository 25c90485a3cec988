#!/usr/bin/env bash
# One device call: install the wheels brought along, run the GPU tests, then the benchmarks.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_session.sh [bench args...]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 240 python3 -m pytest -q tests/test_gpu_engine.py tests/test_sampler.py 2>&1 | tail -n 15
for spec in "$@"; do
  # each spec: "model workload num_seqs max_len [extra flags]"
  set -- $spec
  echo "== bench_offline $spec"
  timeout 300 python3 benchmarks/bench_offline.py --model "$1" --workload "$2" --num-seqs "$3" --max-len "$4" "${@:5}" 2>&1 | tail -n 3 | tee -a "$OUT/bench.jsonl"
done
