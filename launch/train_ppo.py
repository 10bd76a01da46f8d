"""PPO:
`python launch/train_ppo.py --config examples/ppo_arith.yaml [key.sub=value ...]`.

`megalign.trainers.ppo` says what it does; `launch/train.py` how it starts (one process, torchrun, srun, mpirun).
"""
from train import run

if __name__ == "__main__":
    run("ppo")
