"""Supervised fine-tuning:
`python launch/train_sft.py --config examples/sft_arith.yaml [key.sub=value ...]`.

`megalign.trainers.sft` says what it does; `launch/train.py` how it starts (one process, torchrun, srun, mpirun).
"""
from train import run

if __name__ == "__main__":
    run("sft")
