#!/usr/bin/env bash
# Compile and link megalign._C with the CUDA kernels AND the CUDA torch glue (csrc/torch/cuda/)
# on a machine without a GPU: a CUDA build of torch (2.14.1+cu130, matching nvcc 13) in its own
# venv provides the ATen CUDA headers the CPU wheel lacks. The build happens in a copy of the
# sources (build/cuda-check/src) so the checkout's CPU extension is untouched; then every op
# must have a CUDA kernel registered, and the op tests run on the CPU against that torch.
#   scripts/check_cuda_build.sh [venv-dir]      (CUDA_HOME defaults to /usr/local/cuda)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(realpath -m "${1:-.venv-cuda}")"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "check_cuda_build: no nvcc in CUDA_HOME=$CUDA_HOME; set CUDA_HOME" >&2; exit 1; }

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q torch==2.14.1 ninja setuptools wheel pytest pyyaml safetensors numpy
"$VENV/bin/python" -c "import torch; assert torch.version.cuda, 'torch 2.14.1 here is not a CUDA build'"
# ATen's CUDA headers include cuSPARSE/cuBLAS headers, which ship in the nvidia wheels.
NV_INC="$("$VENV/bin/python" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'include'))")"

SRC=build/cuda-check/src
mkdir -p "$SRC"
cp -r setup.py pyproject.toml README.md csrc megalign tests "$SRC/"
cd "$SRC"
CPATH="$NV_INC${CPATH:+:$CPATH}" MEGALIGN_CUDA_ARCHS="${MEGALIGN_CUDA_ARCHS:-80;90}" MAX_JOBS="${MAX_JOBS:-2}" \
  "$VENV/bin/python" setup.py -q build_ext --inplace
PYTHONPATH="$PWD" "$VENV/bin/python" "$OLDPWD/scripts/check_op_kernels.py" CUDA  # megalign from this copy
MEGALIGN_REQUIRE_EXT=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/ops
