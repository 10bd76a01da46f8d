"""KTO (unpaired desirable / undesirable examples):
`python launch/train_kto.py --config examples/kto_arith.yaml [key.sub=value ...]`.

`megalign.trainers.kto` says what it does; `launch/train.py` how it starts (one process, torchrun, srun, mpirun).
"""
from train import run

if __name__ == "__main__":
    run("kto")
