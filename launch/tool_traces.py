"""The embedded `tools` demonstration's data and its before/after table (issue 28):

    python launch/tool_traces.py data [key=value ...]     # SFT traces driven through ToolEnv + prompt files (ToolTracesConfig)
    python launch/tool_traces.py compare [key=value ...]  # held-out accuracy with / without tools, ending `change` (ToolCompareConfig)

Each also takes `--config FILE.yaml` and `--help`; `compare` runs as one process or under `torchrun` (the prompts
are split over the processes); `data` writes the same files either way (rank 0 writes them).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.data.tool_traces import ToolTracesConfig, write_tool_traces  # noqa: E402
from megalign.tools.tool_compare import ToolCompareConfig, compare_tools  # noqa: E402
from megalign.trainers.cli import main, on_rank0  # noqa: E402

COMMANDS = {"data": (ToolTracesConfig, on_rank0(write_tool_traces)), "compare": (ToolCompareConfig, compare_tools)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(COMMANDS)}}} [--config FILE] [key=value ...]")
    main(*COMMANDS[sys.argv[1]], sys.argv[2:])
