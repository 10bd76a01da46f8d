#!/usr/bin/env bash
# The test command (README): every pytest test except those marked slow or needing CUDA hardware
# (CUDA tests skip themselves without a GPU). The slow ones are .ci/run's next lane,
# `python -m pytest -q -m slow`. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -m "not slow" "$@"
