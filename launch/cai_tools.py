"""Constitutional AI / RLAIF data from a policy's own samples (`megalign.tools.cai`, `megalign.tools.cai_revise`):

    python launch/cai_tools.py label policy=DIR judge.path=DIR judge.template=... [key=value ...]
        # two samples per prompt ordered by a judge model -> TRL preference rows (pairs.jsonl)
    python launch/cai_tools.py critique-revise policy=DIR constitution=FILE [rounds=N reviser=DIR ...]
        # sample, then N rounds of critique + revision against drawn principles -> SFT rows (sft.jsonl)

Each also takes `--config FILE.yaml` and `--help`; runs as one process or under `torchrun` (the prompts
are split over the processes in chunks), and a rerun with the same config resumes where a crash stopped it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.tools.cai import LabelConfig, label  # noqa: E402
from megalign.tools.cai_revise import CritiqueReviseConfig, critique_revise  # noqa: E402
from megalign.trainers.cli import main  # noqa: E402

COMMANDS = {"label": (LabelConfig, label), "critique-revise": (CritiqueReviseConfig, critique_revise)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(COMMANDS)}}} [--config FILE] [key=value ...]")
    main(*COMMANDS[sys.argv[1]], sys.argv[2:])
