"""Process (or outcome) reward model on stepwise rows:
`python launch/train_prm.py --config examples/prm_chain.yaml [key.sub=value ...]`.

`megalign.trainers.prm` says what it does; `launch/train.py` how it starts (one process, torchrun, srun, mpirun).
"""
from train import run

if __name__ == "__main__":
    run("prm")
