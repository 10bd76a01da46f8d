"""Reward model (Bradley-Terry on preference pairs):
`python launch/train_rm.py --config examples/rm_arith.yaml [key.sub=value ...]`.

Runs as one process with plain `python`, or on several with `torchrun --nproc-per-node N` (gloo on
CPU, NCCL on GPUs); see `megalign.trainers.preference` (`train_rm`) for what it does and `megalign.trainers.cli.main`
for argv, config and process group.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.trainers.cli import main  # noqa: E402
from megalign.trainers.preference import RMConfig, train_rm  # noqa: E402

if __name__ == "__main__":
    main(RMConfig, train_rm, sys.argv[1:])
