#!/usr/bin/env bash
# One prepared GPU check (run it through the device tool when a GPU is lent): build megalign._C
# with the CUDA kernels, run every test including the CUDA ones (kernels vs references on the GPU),
# and measure the token_logprob forward bandwidth at N=8192, V=151936 bf16 as a fraction of HBM
# bandwidth (MEGALIGN_HBM_GBPS, default 4800 for an H200).
# Results go to $OUT (default ./gpu_results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
{
  nvidia-smi
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} >"$OUT/device.txt" 2>&1

export MEGALIGN_CUDA_ARCHS="${MEGALIGN_CUDA_ARCHS:-90}"
MAX_JOBS="${MAX_JOBS:-16}" python -m pip install -q --no-build-isolation -e . >"$OUT/build.log" 2>&1 \
  || { echo "build failed, see $OUT/build.log"; tail -50 "$OUT/build.log"; exit 1; }
python -c "import megalign.ops as o; assert o.WITH_CUDA, 'CUDA kernels not built'" || exit 1

MEGALIGN_REQUIRE_EXT=1 python -m pytest -q -m "not slow" tests >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -5 "$OUT/pytest.log"
python benchmarks/bench_token_logprob.py --gpu-bandwidth >"$OUT/bandwidth.txt" 2>&1
cat "$OUT/bandwidth.txt"
