"""Verifier-labelled preference pairs from a policy's own samples (the RM data of `run_embedded.sh ppo`):
`python launch/sample_pairs.py model_path=runs/sft_arith/hf out_dir=runs/self_pairs [key=value ...]`.

Runs as one process with plain `python`, or on several with `torchrun --nproc-per-node N` (the
prompts split over the ranks); see `megalign.tools.self_pairs` for what it writes.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.trainers.cli import main  # noqa: E402
from megalign.tools.self_pairs import SelfPairsConfig, sample_pairs  # noqa: E402

if __name__ == "__main__":
    main(SelfPairsConfig, sample_pairs, sys.argv[1:])
