"""Process-supervision data from a policy's own samples (`megalign.tools.best_of_n`):

    python launch/prm_tools.py data [key=value ...]    # the chains' SFT rows (ChainDataConfig)
    python launch/prm_tools.py label [key=value ...]   # Monte-Carlo step labels (LabelStepsConfig)
    python launch/prm_tools.py best_of_n [key=value ...]  # held-out best-of-N with the PRM / ORM (BestOfNConfig)

Each also takes `--config FILE.yaml` and `--help`; runs as one process or under `torchrun` (the prompts
are split over the processes).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.tools.best_of_n import (BestOfNConfig, ChainDataConfig, LabelStepsConfig, best_of_n,  # noqa: E402
                                      label_steps, write_chain_data)
from megalign.trainers.cli import main  # noqa: E402

COMMANDS = {"data": (ChainDataConfig, write_chain_data), "label": (LabelStepsConfig, label_steps),
            "best_of_n": (BestOfNConfig, best_of_n)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(COMMANDS)}}} [--config FILE] [key=value ...]")
    main(*COMMANDS[sys.argv[1]], sys.argv[2:])
