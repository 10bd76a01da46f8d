"""Train any registered algorithm: `python launch/train.py --config examples/grpo_arith.yaml [key.sub=value ...]`.

The config names its algorithm (the top-level key `algorithm: grpo`, or the override `algorithm=grpo`);
`--help` lists the registered ones (`megalign.algos.registry`). Each `launch/train_<name>.py` is
`run("<name>")` of this file: the same start for one algorithm, by the path users and Slurm scripts call.

Runs as one process with plain `python`, or on several with `torchrun --nproc-per-node N`, `srun` or
`mpirun` (gloo on CPU, NCCL on GPUs); `megalign.trainers.cli` reads argv, the config and the launcher.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout runs uninstalled

from megalign.trainers.cli import run_algorithm  # noqa: E402


def run(name=None):
    """Train algorithm `name` (None: the one the config names) with this process's command line."""
    return run_algorithm(name, sys.argv[1:])


if __name__ == "__main__":
    run()
