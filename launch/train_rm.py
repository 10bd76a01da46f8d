"""Reward model (Bradley-Terry on preference pairs):
`python launch/train_rm.py --config examples/rm_arith.yaml [key.sub=value ...]`.

`megalign.trainers.preference` says what it does; `launch/train.py` how it starts (one process, torchrun, srun, mpirun).
"""
from train import run

if __name__ == "__main__":
    run("rm")
