"""The embedded `user_sim` demonstration's data and its before/after table (issue 28):

    python launch/user_sim.py data [key=value ...]     # traces of the impatient scripted assistant + prompt rows (UserSimTracesConfig)
    python launch/user_sim.py compare [key=value ...]  # the simulated user's score before / after GRPO, ending `change` and `ratio` (UserSimCompareConfig)

Each also takes `--config FILE.yaml` and `--help`; `compare` runs as one process or under `torchrun` (the rows are
split over the processes); `data` writes the same files either way (rank 0 writes them).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.data.user_sim_traces import UserSimTracesConfig, write_user_sim_traces  # noqa: E402
from megalign.tools.user_sim_compare import UserSimCompareConfig, compare_user_sim  # noqa: E402
from megalign.trainers.cli import main, on_rank0  # noqa: E402

COMMANDS = {"data": (UserSimTracesConfig, on_rank0(write_user_sim_traces)),
            "compare": (UserSimCompareConfig, compare_user_sim)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(COMMANDS)}}} [--config FILE] [key=value ...]")
    main(*COMMANDS[sys.argv[1]], sys.argv[2:])
