"""GRPO:
`python launch/train_grpo.py --config examples/grpo_arith.yaml [key.sub=value ...]`.

`megalign.trainers.grpo` says what it does; `launch/train.py` how it starts (one process, torchrun, srun, mpirun).
"""
from train import run

if __name__ == "__main__":
    run("grpo")
