#!/usr/bin/env bash
# The embedded default end to end on one machine: SFT warm start of a tiny character model on the
# arithmetic task, then GRPO from its HF export, ending with the before/after held-out accuracy table.
#   launch/run_embedded.sh [RUN_ROOT] [NPROC]      (defaults: runs, 2 processes; CPU gloo or GPUs NCCL)
# Extra `key=value` overrides for GRPO go in GRPO_OVERRIDES, for SFT in SFT_OVERRIDES.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${1:-runs}
NPROC=${2:-2}
PYTHON=${PYTHON:-python}
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" launch/train_sft.py --config examples/sft_arith.yaml \
    run_dir="$ROOT/sft_arith" ${SFT_OVERRIDES:-}
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" launch/train_grpo.py --config examples/grpo_arith.yaml \
    run_dir="$ROOT/grpo_arith" actor.path="$ROOT/sft_arith/hf" ${GRPO_OVERRIDES:-}
