"""Process (or outcome) reward model on stepwise rows:
`python launch/train_prm.py --config examples/prm_chain.yaml [key.sub=value ...]`.

Runs as one process with plain `python`, or on several with `torchrun --nproc-per-node N` (gloo on
CPU, NCCL on GPUs); see `megalign.trainers.prm` (`train_prm`) for what it does and `megalign.trainers.cli.main`
for argv, config and process group.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.trainers.cli import main  # noqa: E402
from megalign.trainers.prm import PRMConfig, train_prm  # noqa: E402

if __name__ == "__main__":
    main(PRMConfig, train_prm, sys.argv[1:])
