"""Online DPO: `python launch/train_online_dpo.py --config examples/online_dpo_arith.yaml [key.sub=value ...]`.

Runs as one process with plain `python`, or on several with `torchrun --nproc-per-node N` (gloo on
CPU, NCCL on GPUs); see `megalign.trainers.online_dpo` for what it does and `megalign.trainers.cli.main`
for argv, config and process group.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.trainers.cli import main  # noqa: E402
from megalign.trainers.online_dpo import OnlineDPOConfig, train_online_dpo  # noqa: E402

if __name__ == "__main__":
    main(OnlineDPOConfig, train_online_dpo, sys.argv[1:])
