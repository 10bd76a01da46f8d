"""The embedded judge's data and its held-out agreement (`megalign.tools.judge_data`):

    python launch/judge_tools.py data [key=value ...]       # judge SFT rows + rubric prompt rows (JudgeDataConfig)
    python launch/judge_tools.py agreement [key=value ...]  # the trained judge vs the labels (JudgeAgreementConfig)
    python launch/judge_tools.py compare [key=value ...]    # held-out accuracy before / after, ending `change` (CompareConfig)

Each also takes `--config FILE.yaml` and `--help`; runs as one process or under `torchrun` (the problems
or rows are split over the processes).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.tools.judge_data import (CompareConfig, JudgeAgreementConfig, JudgeDataConfig, compare,  # noqa: E402
                                       judge_agreement, write_judge_data)
from megalign.trainers.cli import main  # noqa: E402

COMMANDS = {"data": (JudgeDataConfig, write_judge_data), "agreement": (JudgeAgreementConfig, judge_agreement),
            "compare": (CompareConfig, compare)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(COMMANDS)}}} [--config FILE] [key=value ...]")
    main(*COMMANDS[sys.argv[1]], sys.argv[2:])
