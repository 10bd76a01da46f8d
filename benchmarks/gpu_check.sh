#!/usr/bin/env bash
# The prepared GPU check: one script for a short lent GPU slot (the device tool), every step bounded
# in time and logged under $OUT (default ./gpu_results), a failing step reported and the next one run.
#   benchmarks/gpu_check.sh          on a CUDA machine (python3 holds torch there)
#   benchmarks/gpu_check.sh --cpu    the same steps on this machine's CPU (no build, no sanitizer),
#                                    so a typo is found here and not in the GPU slot
# Steps (each under its own time limit; 322 s in all on an H200 on 2026-12-04, BENCHMARKS.md):
#   1 build   pip install --no-build-isolation --no-deps -e . for sm_90 (MEGALIGN_CUDA_ARCHS), then
#             every megalign:: op must have a CUDA kernel (scripts/check_op_kernels.py)
#   2 tests   the CUDA tests only (ops on CUDA tensors, the CUDA-graph rollout, flash-attention),
#             each under pytest-timeout
#   3 probe   benchmarks/gpu_probe.py: token_logprob at N*V > 2^31 and the fused head against fp32
#             torch, the NaN-row and GAE lam = 0 cases, CUDA-event timings beside amax / clone
#   4 e2e     benchmarks/gpu_e2e.py: GRPO and PPO end to end for two steps (bf16, static rollout
#             with CUDA graphs, SDPA, NCCL at world size 1) and the rollout engine's tokens/s
#   5 models  benchmarks/gpu_models.py (issues 29, 30; budget 270 s, not yet run on a GPU): GRPO of a Qwen3-1.7B-sized
#             random model in bf16, a LoRA step of a Qwen3-8B-sized one (planner checked first), a tiny Qwen3-MoE
#             with routing replay off and on; generation / update tokens/s, peak memory, rollout/logprob_* probes
#   6 sanitize benchmarks/gpu_sanitize.py under compute-sanitizer memcheck (every op at odd sizes)
#             and racecheck (gae, token_logprob)
# The device tool brings back at most 8 files: one log per step plus summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
MODE=cuda
[ "${1:-}" = --cpu ] && MODE=cpu
if [ "$MODE" = cpu ]; then PY="${PYTHON:-python}"; else PY="${PYTHON:-python3}"; fi
export PYTHONUNBUFFERED=1
failed=0

# step NAME LIMIT CMD...: run CMD under `timeout LIMIT`, output to $OUT/NAME.log, a line in summary.txt.
step() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=15 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  return "$rc"
}

{
  date -u
  nvidia-smi 2>&1 | head -15
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
} >"$OUT/build.log" 2>&1
cat "$OUT/build.log"

if [ "$MODE" = cuda ]; then
  export MEGALIGN_CUDA_ARCHS="${MEGALIGN_CUDA_ARCHS:-90}"
  step build 300 env MAX_JOBS="${MAX_JOBS:-16}" "$PY" -m pip install --no-build-isolation --no-deps -e . \
    || { echo "build failed: nothing else can run"; exit 1; }
  step build 30 "$PY" scripts/check_op_kernels.py CUDA
else
  step build 30 "$PY" scripts/check_op_kernels.py CPU
fi

timeout_arg=()
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_arg=(--timeout 120)
MEGALIGN_REQUIRE_EXT=1 step tests 200 "$PY" -m pytest -q -p no:cacheprovider -rfE --maxfail 25 "${timeout_arg[@]}" \
  -k "cuda or graph" tests/ops tests/rollout/test_engine.py tests/rollout/test_engine_autocast.py \
  tests/models/test_flash_attention.py

step probe 150 "$PY" benchmarks/gpu_probe.py --device "$MODE" --out "$(mktemp -d)"

e2e_args=(--out "$(mktemp -d)")
[ "$MODE" = cpu ] && e2e_args+=(--device cpu --tiny)
step e2e 200 "$PY" benchmarks/gpu_e2e.py "${e2e_args[@]}"

models_args=(--out "$(mktemp -d)")
[ "$MODE" = cpu ] && models_args+=(--device cpu --tiny)
step models 290 "$PY" benchmarks/gpu_models.py "${models_args[@]}"

if [ "$MODE" = cuda ] && command -v compute-sanitizer >/dev/null; then
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  step sanitize 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" benchmarks/gpu_sanitize.py
  step sanitize 100 compute-sanitizer --tool racecheck --error-exitcode 9 "$PY" benchmarks/gpu_sanitize.py \
    --only gae token_logprob
else
  step sanitize 60 "$PY" benchmarks/gpu_sanitize.py --device "$MODE"
fi

echo "== summary ($failed failed)"
cat "$OUT/summary.txt"
exit "$failed"
