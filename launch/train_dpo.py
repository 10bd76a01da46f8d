"""Pairwise preference training (DPO family, SimPO, CPO, ORPO by `algo.loss`):
`python launch/train_dpo.py --config examples/dpo_arith.yaml [key.sub=value ...]`.

`megalign.trainers.preference` says what it does; `launch/train.py` how it starts (one process, torchrun, srun, mpirun).
"""
from train import run

if __name__ == "__main__":
    run("dpo")
