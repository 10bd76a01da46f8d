"""The embedded MoE run's own steps (`launch/run_embedded.sh moe`; `megalign.tools.moe_run`):

    python launch/moe_run.py init [key=value ...]     # a tiny Qwen3-MoE from scratch as an HF folder (ScratchMoEConfig)
    python launch/moe_run.py summary [key=value ...]  # held-out before / after and log-prob mismatch (MoERunSummaryConfig)

Each also takes `--config FILE.yaml` and `--help`; under torchrun rank 0 does the work and the others wait.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.tools.moe_run import MoERunSummaryConfig, ScratchMoEConfig, summarize_moe_run, write_scratch_moe  # noqa: E402
from megalign.trainers.cli import main, on_rank0  # noqa: E402

COMMANDS = {"init": (ScratchMoEConfig, on_rank0(write_scratch_moe)),
            "summary": (MoERunSummaryConfig, on_rank0(summarize_moe_run))}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(COMMANDS)}}} [--config FILE] [key=value ...]")
    main(*COMMANDS[sys.argv[1]], sys.argv[2:])
