"""Training loops and what they share: typed run configs, optimizer and LR schedule (`optim`), metrics
(`logging`: MetricsLogger, PhaseTimer, memory_report), launch helpers (`cli`), and the SFT stage (`sft`).

Checkpoints live in `megalign.checkpoint`. Submodules are imported directly (`from megalign.trainers.sft
import train_sft`) so that importing one trainer does not import the others.
"""
