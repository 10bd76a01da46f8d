"""Online DPO:
`python launch/train_online_dpo.py --config examples/online_dpo_arith.yaml [key.sub=value ...]`.

`megalign.trainers.online_dpo` says what it does; `launch/train.py` how it starts (one process, torchrun, srun, mpirun).
"""
from train import run

if __name__ == "__main__":
    run("online_dpo")
