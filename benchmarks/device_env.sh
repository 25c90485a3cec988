# Sourced by gpu_session.sh and multi_gpu_session.sh on the GPU machine (repo root): installs the
# wheels brought in .whl/, sets the environment, restores the compiled kernels carried in .jit/
# (once per machine), and defines save_jit_cache, which puts them in $OUT to carry next time.
# Once per machine: a script sourced again (a queue's step running multi_gpu_session.sh) must not
# reinstall under processes that are importing from /tmp/site.
if [ ! -f /tmp/site-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site-installed
fi
# The Triton kernels in kernels/ import as rollout_kernels (pyproject's package-dir).
ln -sfn "$PWD/kernels" /tmp/site/rollout_kernels
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-ws}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$FLASHINFER_WORKSPACE_BASE" "$TRITON_CACHE_DIR"
# What the engine, the servers and the GPU tests import that the device's image lacks comes as
# wheels in .whl/: a module still missing is named here, before any model loads (a server that
# cannot import its HTTP stack otherwise fails only once a benchmark starts it).
MISSING=$(PYTHONPATH=/tmp/site python3 - <<'PY'
import importlib, importlib.util
missing = []
for name in ["zmq", "fastapi", "uvicorn", "httptools", "uvloop", "aiohttp", "httpx",
             "prometheus_client", "jsonschema", "pytest_timeout", "requests"]:
    try:  # imported: a dependency of theirs that is missing shows too
        importlib.import_module(name)
    except ImportError as e:
        missing.append(f"{name} ({e})")
missing += [n for n in ("flashinfer", "torch_memory_saver") if importlib.util.find_spec(n) is None]
if missing:
    print("device_env: MISSING (bring the wheels in .whl/):", "; ".join(missing), flush=True)
PY
)
[ -n "$MISSING" ] && echo "$MISSING" | tee -a "$OUT/log"
# Restored again when the carried caches change (a warm machine keeps the first call's flag): a
# call that brings caches built on another machine would otherwise compile everything anew.
JIT_STAMP=$(cat .jit/*.tgz 2>/dev/null | md5sum | cut -c1-32)
if [ "$(cat /tmp/jit-restored 2>/dev/null)" != "$JIT_STAMP" ]; then
  if [ -f .jit/flashinfer-jit.tgz ]; then
    tar -xzf .jit/flashinfer-jit.tgz -C "$FLASHINFER_WORKSPACE_BASE" && echo "restored FlashInfer JIT cache"
    # A module built from the package's own sources (the all-reduce fusion's trtllm_comm) is
    # rebuilt by ninja on a new machine whatever the carried objects' times; FlashInfer loads a
    # library under its AOT directory as it is, so the carried libraries go there too.
    for so in "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
      name=$(basename "$so" .so)
      [ "$name" = "$(basename "$(dirname "$so")")" ] || continue
      mkdir -p "/tmp/site/flashinfer/data/aot/$name" && cp "$so" "/tmp/site/flashinfer/data/aot/$name/"
    done
  fi
  if [ -f .jit/triton-cache.tgz ]; then
    tar -xzf .jit/triton-cache.tgz -C "$TRITON_CACHE_DIR" && echo "restored Triton cache"
  fi
  echo "$JIT_STAMP" > /tmp/jit-restored
fi
save_jit_cache() {
  tar -czf "$OUT/flashinfer-jit.tgz" -C "$FLASHINFER_WORKSPACE_BASE" .cache 2>/dev/null && ls -la "$OUT/flashinfer-jit.tgz"
  tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null && ls -la "$OUT/triton-cache.tgz"
  # What a device call can carry is limited (64 MiB with the wheels): a larger cache is dropped.
  find "$OUT" -maxdepth 1 -name triton-cache.tgz -size +30M -print -delete
}
