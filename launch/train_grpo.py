"""GRPO: `python launch/train_grpo.py --config examples/grpo_arith.yaml [key.sub=value ...]`.

Runs as one process with plain `python`, or on several with `torchrun --nproc-per-node N` (gloo on
CPU, NCCL on GPUs); see `megalign.trainers.grpo` for what it does and `megalign.trainers.cli` for the
process-group choice.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megalign.config import load_config  # noqa: E402
from megalign.trainers.cli import init_distributed, parse_cli, setup_logging  # noqa: E402
from megalign.trainers.grpo import GRPOConfig, train_grpo  # noqa: E402


def main(argv):
    config_path, overrides = parse_cli(argv)
    cfg = load_config(GRPOConfig, config_path, overrides)
    init_distributed(cfg.device)
    setup_logging(dist.get_rank())
    try:
        train_grpo(cfg)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
