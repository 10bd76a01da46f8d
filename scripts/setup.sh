#!/usr/bin/env bash
# Create a virtual environment (default .venv, or the path given) with the pinned CPU torch and
# the test dependencies, then build megalign._C into this checkout (editable install).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# torch first and pinned (the CPU build on local disk); then megalign with its test extras
# (pytest, transformers for the parity tests, pyarrow for Parquet), building megalign._C.
"$VENV/bin/python" -m pip install -q torch==2.13.0 ninja setuptools wheel
"$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[test]"
"$VENV/bin/python" -c "import megalign.ops as o; print('megalign kernels built:', o.HAVE_EXTENSION, '| CUDA kernels:', o.WITH_CUDA)"
