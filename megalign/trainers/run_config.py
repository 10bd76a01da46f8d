"""What every run's config has (`RunConfig`, `DataConfig`), what its values mean, and which may change on resume.

A trainer's config subclasses `RunConfig`, so the keys stay top-level (`steps=...`) and are declared
once; a trainer changes a default by redeclaring that one field. Its data section subclasses
`DataConfig`, which is how the data files of every trainer are found (`data_paths`) and fingerprinted
in each checkpoint (`megalign.checkpoint.data_files`) without the trainer naming them.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Literal, Optional

import numpy as np
import torch

from megalign.config import option
from megalign.data import ArithTaskConfig, TokenizerConfig
from megalign.trainers.log_backends import LoggingConfig


@dataclasses.dataclass
class RunConfig:
    """What every run has, whatever it trains: where it writes, how long, seeds, checkpoints, logging."""

    run_dir: str = option("runs/run", doc="output folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, hf/")
    steps: int = option(100, doc="training steps (optimizer steps; for RL, one rollout and its updates each)")
    seed: int = option(0, doc="seed of model init, data order, sampling and every RNG")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")
    save_every: int = option(100, doc="checkpoint every N steps (and always after the last); 0: only after the last")
    save_every_minutes: float = option(
        0.0, doc="also checkpoint at the end of the first step that finds this many minutes passed since the last "
                 "checkpoint (or the start); 0: off. A SIGTERM / SIGUSR1 always checkpoints the current step and "
                 "exits with status 75")
    keep_last: int = option(2, doc="completed checkpoints to keep")
    resume: str = option("auto", doc="'auto' (latest checkpoint in run_dir, if any), 'none', a step number or a checkpoint folder")
    overwrite_checkpoints: bool = option(
        False, doc="a run that does not continue the checkpoints in run_dir (resume=none, or from an earlier step): "
                   "delete them at start-up; false: refuse to start")
    resume_changes: Literal["error", "allow"] = option(
        "error", doc="resuming with a config whose meaning changed (model, data, objective, lr...): 'error' or 'allow' (warned)")
    export_hf: bool = option(True, doc="write the final model in HF format (with tokenizer files) to run_dir/hf")
    log_every: int = option(1, doc="write metrics every N steps (and always the last)")
    tensorboard: bool = option(True, doc="also write TensorBoard scalars (false: the same as leaving tensorboard out of logging.backends)")
    logging: LoggingConfig = option(LoggingConfig(), doc="metric backends (jsonl, tensorboard, wandb, mlflow) and the run's "
                                                         "project and name in W&B / MLflow")
    watchdog_minutes: float = option(
        30.0, doc="stop the job (exit status 124, naming the phase and every thread's stack) when a rank makes no "
                  "progress (no timed phase starts or ends) for this many minutes; must exceed the longest phase "
                  "(a whole evaluation, a checkpoint); 0: off")
    max_skipped_fraction: float = option(
        0.5, doc="fail the run (after its last checkpoint, before the export) when more than this fraction of the "
                 "steps meant to update the policy skipped their update (NaN, no informative group); 1: only a "
                 "run whose policy never moved fails")

    def __post_init__(self):
        for name in ("steps", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.save_every < 0 or self.seed < 0:
            raise ValueError(f"save_every and seed must be >= 0, got {self.save_every}, {self.seed}")
        if self.save_every_minutes < 0:
            raise ValueError(f"save_every_minutes must be >= 0, got {self.save_every_minutes}")
        if not (math.isfinite(self.watchdog_minutes) and self.watchdog_minutes >= 0):
            raise ValueError(f"watchdog_minutes must be a finite number >= 0, got {self.watchdog_minutes}")
        if not 0 <= self.max_skipped_fraction <= 1:
            raise ValueError(f"max_skipped_fraction must be in [0, 1], got {self.max_skipped_fraction}")


@dataclasses.dataclass
class DataConfig:
    """Training data and held-out prompts: the embedded arithmetic task, or files. Trainers add their length limit."""

    path: Optional[str] = option(None, doc="training data file; null: the train split of the arithmetic task")
    eval_path: Optional[str] = option(None, doc="held-out prompt file (rows: prompt or messages, answer); null: the arithmetic held-out split when path is null, else no evaluation")
    arith: ArithTaskConfig = option(ArithTaskConfig(), doc="the embedded arithmetic task (used when path is null)")
    tokenizer: TokenizerConfig = option(TokenizerConfig(), doc="tokenizer (the built-in character one by default)")
    skip_invalid: bool = option(False, doc="skip and count malformed rows instead of failing on the first")
    template_prompts: bool = option(False, doc="wrap prompt strings as a user message through the chat template")
    shuffle: bool = option(True, doc="reshuffle the training data every epoch (seeded by seed and epoch)")


RUN_FREE_KEYS = ("run_dir", "steps", "device", "save_every", "save_every_minutes", "keep_last", "resume",
                 "overwrite_checkpoints", "resume_changes", "export_hf", "log_every", "tensorboard", "logging",
                 "max_skipped_fraction", "watchdog_minutes", "eval")
"""Config keys (dotted prefixes) a resumed run may change without changing what it trains: where and
how often it writes, how long it runs (a cosine schedule is recomputed for the new length) and how it
evaluates. Anything else differing from the checkpoint's config is a `resume_changes` error."""


def resolve_device(device: str) -> str:
    """"cpu" or "cuda" for a `RunConfig.device` value."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (model init, shuffles, dropout)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def data_paths(cfg: Any, prefix: str = "") -> dict[str, Optional[str]]:
    """{dotted config key: path or None} of the data files config `cfg` names: the `path` and `eval_path` of every
    `DataConfig` in it (any subclass, at any depth), so every trainer's data is found without naming it."""
    found: dict[str, Optional[str]] = {}
    for field in dataclasses.fields(cfg):
        value, key = getattr(cfg, field.name), f"{prefix}{field.name}"
        if isinstance(value, DataConfig):
            found.update({f"{key}.path": value.path, f"{key}.eval_path": value.eval_path})
        elif dataclasses.is_dataclass(value):
            found.update(data_paths(value, f"{key}."))
    return found
