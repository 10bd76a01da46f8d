"""The one trainer lifecycle every trainer runs on: torchtitan's shape, one `Trainer`, the algorithm in what it is given.

A trainer is a subclass that builds its tokenizer, data and roles in `__init__` (after the base has
set the run up), registers what a checkpoint must hold, and implements `train_step`; the base owns
the rest, so a new objective or role never copies the plumbing:

    start-up (`Trainer.__init__`): device -> the run directory's lock (`megalign.checkpoint.lock`: a
    second job on it fails here, naming the first) -> resume point resolved, and the checkpoint's config
    compared with this one before any model is built (`check_resume_config`: keys outside
    `RUN_FREE_KEYS` and `free_keys()` that differ are an error unless `resume_changes=allow`)
    -> checkpoints in run_dir that the run does not continue (another run's, `not_continued`) refuse
    the start, unless `overwrite_checkpoints` deletes them -> run_dir/checkpoints must take a file and
    have room for one checkpoint (`checkpoint_bytes`) -> run_dir/config.yaml (`write_run_config`: an earlier, different one is kept as config.<N>.yaml)
    -> every RNG seeded -> [subclass: tokenizer, data, roles, `register_state`]
    `train()`: load the checkpoint -> `on_train_start` -> evaluation before training (`eval_before`, once per run)
    -> loop { `train_step` -> metrics (file, TensorBoard, progress bar) -> evaluation every
    `eval_every()` steps -> the ranks agree on a stop signal and a time-based save
    (`megalign.trainers.stopping`) -> checkpoint every `save_every` steps, after `save_every_minutes`,
    on a signal (then exit with status 75) and after the last } -> HF export
    -> final evaluation -> before/after table -> the lock released (also when the run fails).
    All of `train()` runs under the step watchdog (`megalign.trainers.watchdog`): a rank with no phase
    edge for `watchdog_minutes` ends the job naming the phase.

Design choices:

- `RunConfig` holds what every run has (run dir, steps, seed, device, save / keep / resume, export,
  logging); a trainer's config subclasses it, so the keys stay top-level (`steps=...`) and are
  declared once. A trainer changes a default by redeclaring that one field.
- Checkpoint state is a registry (`register_state(key, stateful)`): the base registers the RNG
  states and the progress counters, a trainer adds its models, optimizers, sampler and generators.
  Resume is exact because everything that a step reads is in there.
- Skipped updates have one path: a role's `optimizer_step` decides (non-finite loss or gradient norm
  on any rank, `megalign.roles.actor.TrainableRole`), the trainer reports through `skip_update`,
  which warns with the step number and counts per reason in `progress` (`nan_skips`,
  `empty_updates`), so every trainer logs the same counters.
- A run that does not train must not look like one that did (a reward model returning NaN, online
  DPO where every group ties, exits 0 with the initial model exported otherwise). The loop classifies
  every step by the trainer's `policy_role()`: its optimizer stepped (`progress["updates"]`), or an
  update was skipped and it did not (`progress["skipped_steps"]`), or neither (the policy waits by
  design, PPO's critic warm-up). After the last step and its checkpoint, a run whose policy never
  moved, or that skipped more than `max_skipped_fraction` of the steps meant to move it, raises
  `SkippedUpdatesError` with the counts by reason before anything is exported; otherwise the closing
  lines state how many updates happened.
- Metrics are reduced over ranks through `MetricSums`: named sums, one all-reduce, then named
  means; no positional `total[8]`.
- The progress bar shows `loss`, `reward/mean` and `accuracy` (`MetricsLogger.PROGRESS_KEYS`)
  whichever trainer runs, and is updated on every logged step including the last.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import random
import shutil
from typing import Any, Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from megalign.checkpoint import (CheckpointManager, Counters, RNGState, RunDirLock, check_resume_config, with_defaults,
                                 write_run_config)
from megalign.config import ConfigError, option, to_dict
from megalign.data import ArithTaskConfig, Tokenizer, TokenizerConfig, build_tokenizer, check_vocab
from megalign.parallel import ParallelLayout
from megalign.parallel.collectives import all_reduce
from megalign.plan.model import load_model, total_params
from megalign.roles.actor import TrainableRole
from megalign.trainers.logging import MetricsLogger, PhaseTimer
from megalign.trainers.stopping import PREEMPTED_EXIT_STATUS, Preempted, SaveClock, StopSignals, agree_to_stop
from megalign.trainers.watchdog import Watchdog

logger = logging.getLogger(__name__)


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
    tensorboard: bool = option(True, doc="also write TensorBoard scalars")
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


CHECKPOINT_BYTES_PER_PARAM = 12
"""What a checkpoint holds per trained parameter: its fp32 value and Adam's two fp32 moments."""

SKIP_REASONS = ("nan_skips", "empty_updates")
"""Why an update is skipped (`Trainer.skip_update`), each counted in `progress` and logged every step."""

RUN_FREE_KEYS = ("run_dir", "steps", "device", "save_every", "save_every_minutes", "keep_last", "resume",
                 "overwrite_checkpoints", "resume_changes", "export_hf", "log_every", "tensorboard",
                 "max_skipped_fraction", "watchdog_minutes", "eval")
"""Config keys (dotted prefixes) a resumed run may change without changing what it trains: where and
how often it writes, how long it runs (a cosine schedule is recomputed for the new length) and how it
evaluates. Anything else differing from the checkpoint's config is a `resume_changes` error."""


@dataclasses.dataclass
class TrainResult:
    """What a run reports back."""

    step: int
    """Steps completed (cfg.steps at the end)."""
    metrics: list[dict[str, float]]
    """This invocation's logged metrics per step (a resumed run holds only the steps it ran)."""
    hf_path: Optional[str]
    """Folder of the HF export, or None."""
    accuracy_before: Optional[float] = None
    """Held-out accuracy before training (trainers with `eval_before`; kept across resumes), or None."""
    accuracy: Optional[float] = None
    """Held-out accuracy at the end, in [0, 1], or None when no evaluation ran."""
    updates: int = 0
    """Steps that updated the policy (kept across resumes)."""

    @property
    def accuracy_after(self) -> Optional[float]:
        return self.accuracy


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


class MetricSums:
    """Named float64 sums reduced over a group in one all-reduce: `add` locally, `reduce` to totals.

        sums = MetricSums(); sums.add("reward", rewards.sum()); sums.add("count", rewards.numel())
        totals = sums.reduce(layout.dp_group, device)   # {"reward": ..., "count": ...} over dp
    """

    def __init__(self):
        self._values: dict[str, torch.Tensor] = {}

    def add(self, name: str, value) -> None:
        """Accumulate `value` (a number or a 0-d / 1-element tensor, left on its device: no host sync)."""
        value = torch.as_tensor(value, dtype=torch.float64).detach().reshape(())
        self._values[name] = self._values[name] + value if name in self._values else value

    def add_means(self, metrics) -> None:
        """Add {name: (total, count)} pairs (e.g. `megalign.algos` stats' `metrics()`), to log as total / count."""
        for name, (total, count) in metrics.items():
            self.add(f"{name}/total", total)
            self.add(f"{name}/count", count)

    @staticmethod
    def means(totals: dict[str, float]) -> dict[str, float]:
        """{name: total / count} of the reduced pairs `add_means` added."""
        names = [k[:-len("/total")] for k in totals if k.endswith("/total")]
        return {name: totals[f"{name}/total"] / max(totals[f"{name}/count"], 1.0) for name in names}

    def reduce(self, group: Optional[dist.ProcessGroup], device: torch.device) -> dict[str, float]:
        """{name: sum over the group's ranks}; every rank of the group must add the same names in the same order."""
        if not self._values:
            return {}
        total = all_reduce(torch.stack([v.to(device) for v in self._values.values()]), group).cpu()
        return dict(zip(self._values, total.tolist()))


class SkippedUpdatesError(RuntimeError):
    """The policy never moved, or more of its updates were skipped than `max_skipped_fraction` allows (module doc)."""


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB (a tiny model's checkpoint is not "0.00 GiB")."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def update_summary(progress: dict[str, Any]) -> str:
    """How many steps updated the policy, and the skipped updates by reason: "5 of 6 steps (1 skipped: ...)"."""
    updates, skipped, steps = progress["updates"], progress["skipped_steps"], progress["step"]
    reasons = ", ".join(f"{reason} {progress[reason]}" for reason in SKIP_REASONS)
    waited = steps - updates - skipped
    return (f"{updates} of {steps} steps ({skipped} skipped: {reasons}"
            f"{f'; {waited} waiting by design' if waited > 0 else ''})")


def accuracy_table(before: Optional[float], after: float, steps: int, label: str, trained: str,
                   updates: str) -> str:
    """The before/after held-out accuracy table printed at the end of a run, headed by `label`, with the
    `updates` line (`update_summary`) under it."""
    rows = [("initial model", "-" if before is None else f"{before:6.1%}"), (f"{trained}, {steps} steps", f"{after:6.1%}")]
    if before is not None:
        rows.append(("change", f"{(after - before) * 100:+.1f} points"))
    rows.append(("policy updated in", updates))
    width = max(len(name) for name, _ in rows)
    lines = [label] + [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


class ModelError(ValueError):
    """A model that does not fit the run (vocabulary, positions, layers per stage), named by its config key and
    folder: the launcher prints it as one line, as a config error."""


class ModelPathError(FileNotFoundError):
    """A model folder a config key names that is missing or not an HF checkpoint (one line, as `ModelError`)."""


def check_model_path(path: str, key: str) -> None:
    """ModelPathError naming the config `key` when `path` is not an HF checkpoint folder (no config.json)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "does not exist" if not os.path.exists(path) else "has no config.json"
        raise ModelPathError(
            f"{key}={path!r} {what}: it must be an HF checkpoint folder (e.g. the run_dir/hf export of an SFT run). "
            f"For the embedded example, `launch/run_embedded.sh` creates it (or: python launch/train_sft.py "
            f"--config examples/sft_arith.yaml, which writes runs/sft_arith/hf)")


def check_stages(num_layers: int, pp: int, key: str, what: str) -> None:
    """ModelError naming `key`.pp and `what` (where the layer count comes from) unless pp splits the layers evenly."""
    if num_layers % pp:
        raise ModelError(f"{key}.pp={pp} does not divide the {num_layers} decoder layers of {what}: every pipeline "
                         f"stage holds num_layers / pp layers")


def check_same_batch(layout: ParallelLayout, key: str, data_layout: ParallelLayout, data_key: str) -> None:
    """How data moves between two roles' layouts on the same ranks, checked: a role computes on the batch its ranks
    hold, and the batches are split by `data_layout`'s dp coordinate (every rank of a `data_key` tp x pp replica holds
    that replica's whole batch, pipeline stages included). So each replica of the role (its ranks with one dp
    coordinate: its tp group x pp group) must lie inside one `data_key` replica; then no data moves: a role at pp = 1
    beside a pp > 1 model scores the batch on every stage's ranks (redundantly), and a role's tp group sees one batch.
    ValueError naming both layouts and the offending ranks otherwise (e.g. reference.tp=2 beside model.tp=1, dp=2)."""
    for replica in range(layout.dp):
        ranks = [r for r in range(layout.world_size) if layout.coords(r)["dp"] == replica]
        batches = sorted({data_layout.coords(r)["dp"] for r in ranks})
        if len(batches) > 1:
            raise ValueError(
                f"{key}.tp={layout.tp} x {key}.pp={layout.pp} does not fit {data_key}.tp={data_layout.tp} x "
                f"{data_key}.pp={data_layout.pp}: ranks {ranks} (one {key} replica) hold the batches of {data_key} "
                f"dp ranks {batches} of dp={data_layout.dp}; a {key} replica must lie inside one {data_key} replica")


class Trainer:
    """The lifecycle of one run (module doc); subclasses implement `train_step` and the hooks below."""

    name = "trainer"
    """Shown in logs and the closing table ("SFT", "GRPO")."""
    eval_before = False
    """Whether held-out evaluation also runs before the first step (RL trainers compare with the initial policy)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.device_type = resolve_device(cfg.device)
        if self.device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but CUDA is not available")
        self.rank = dist.get_rank()
        self._layouts: dict[tuple[int, int], ParallelLayout] = {}
        self._accepted_vocab: set[int] = set()
        self.lock = RunDirLock(cfg.run_dir)
        self.on_rank0(self.lock.acquire)  # before anything is written there
        self.checkpoints = CheckpointManager(cfg.run_dir, keep_last=cfg.keep_last)
        self.resume_from = self.checkpoints.resolve_resume(cfg.resume)
        if self.resume_from is not None:
            check_resume_config(with_defaults(type(cfg), self.checkpoints.saved_config(self.resume_from)), to_dict(cfg),
                                RUN_FREE_KEYS + self.free_keys(), cfg.resume_changes == "allow",
                                checkpoint=self.resume_from)
        self.on_rank0(self._claim_checkpoints)  # after the resume checks: a refused resume deletes nothing
        self.on_rank0(self._check_run_dir)  # before any model is built: not at the first save
        if self.rank == 0:
            write_run_config(cfg.run_dir, cfg)  # after the check: a refused resume keeps the run's config.yaml
        seed_everything(cfg.seed)
        self.progress: dict[str, Any] = {"step": 0, **dict.fromkeys(SKIP_REASONS, 0), "accuracy_before": -1.0,
                                         "updates": 0, "skipped_steps": 0}
        self.state: dict[str, Any] = {"rng": RNGState(), "progress": Counters(self.progress)}
        self.watchdog = Watchdog(cfg.watchdog_minutes * 60, lambda: self.progress["step"] + 1, self.rank)
        self.timer = PhaseTimer(self.watchdog)
        self._skipped_in_step = False

    def _claim_checkpoints(self) -> None:
        """Refuse to start beside checkpoints this run does not continue, or delete them (`overwrite_checkpoints`)."""
        others = self.checkpoints.not_continued(self.resume_from)
        if not others:
            return
        start = "from scratch" if self.resume_from is None else f"from {self.resume_from}"
        listed = ", ".join(map(str, others))
        if not self.cfg.overwrite_checkpoints:
            raise ConfigError(
                f"resume={self.cfg.resume!r} starts {start}, but {self.checkpoints.dir} holds checkpoints this run "
                f"does not continue (steps {listed}): its saves would mix with them, pruning would delete its own and "
                f"resume=auto would continue them. Set resume=auto to continue them, overwrite_checkpoints=true to "
                f"delete them first, or another run_dir", key="resume")
        logger.warning("overwrite_checkpoints=true: deleting the checkpoints of steps %s in %s (the run starts %s)",
                       listed, self.checkpoints.dir, start)
        self.checkpoints.delete(others)

    def _check_run_dir(self) -> None:
        """ConfigError naming run_dir unless its checkpoints folder takes a file and has room for one checkpoint
        (`checkpoint_bytes`), so an unwritable or full disk stops the start, not the first save hours later."""
        folder = self.checkpoints.dir
        try:
            os.makedirs(folder, exist_ok=True)
            probe = os.path.join(folder, f".write-test.{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"megalign")
            os.remove(probe)
        except OSError as exc:
            raise ConfigError(f"run_dir={self.cfg.run_dir!r}: cannot write checkpoints in {folder}: "
                              f"{os.strerror(exc.errno) if exc.errno else exc} ({errno.errorcode.get(exc.errno, '?')}"
                              f"{f', {exc.filename}' if exc.filename else ''})", key="run_dir") from exc
        need, free = self.checkpoint_bytes(), shutil.disk_usage(folder).free
        if need > free:
            raise ConfigError(f"run_dir={self.cfg.run_dir!r}: {folder} has {_size(free)} free, but one "
                              f"checkpoint of this run takes about {_size(need)} ({CHECKPOINT_BYTES_PER_PARAM} "
                              f"bytes per trained parameter); free space or use another run_dir", key="run_dir")

    def checkpoint_bytes(self) -> int:
        """About how many bytes one checkpoint takes, from the config alone (no model is built yet): every trained
        model's parameter count (`trained_models`, read from its config.json by the planner) times
        `CHECKPOINT_BYTES_PER_PARAM`. Models whose folder is missing are left to their own start-up check."""
        total = 0
        for _, path in self.trained_models():
            if path is not None and os.path.isfile(os.path.join(path, "config.json")):
                total += total_params(load_model(path)) * CHECKPOINT_BYTES_PER_PARAM
        return total

    # ----- set-up helpers for subclasses

    def on_rank0(self, fn: Callable[[], None]) -> None:
        """Run `fn` on rank 0 alone (a decision about the run directory), then raise its error, if any, on every rank
        together, so no rank goes on to wait in a collective for one that failed."""
        error: list[Optional[BaseException]] = [None]
        if self.rank == 0:
            try:
                fn()
            except Exception as exc:  # sent to every rank, raised there
                error[0] = exc
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise error[0]

    def layout_for(self, tp: int, pp: int = 1, key: str = "model") -> ParallelLayout:
        """The layout with tensor-parallel size `tp` and `pp` pipeline stages (dp = world / (tp x pp)), built once
        and shared by the roles that use it; `key` (the role's config key, e.g. "actor") names the settings in the
        error when tp x pp does not divide the world size."""
        world = dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(f"{key}.tp={tp} x {key}.pp={pp} = {tp * pp} does not divide the world size {world}: "
                             f"dp = world / (tp x pp) must be a whole number")
        if (tp, pp) not in self._layouts:
            self._layouts[tp, pp] = ParallelLayout.build(tp=tp, pp=pp, device_type=self.device_type)
        return self._layouts[tp, pp]

    def build_tokenizer(self, cfg: TokenizerConfig, model_path: Optional[str]) -> Tokenizer:
        """The run's tokenizer (`megalign.data.build_tokenizer`: by default the model folder's own, when it has one)."""
        self.tokenizer = build_tokenizer(cfg, model_path)
        return self.tokenizer

    def check_model(self, model, key: str, path: Optional[str], max_length: int, length_what: str) -> None:
        """Start-up checks of a model (from config key `key`, folder `path` or None) against the run.

        Vocabulary: every tokenizer id must be a row of the model (`check_vocab`), and a model with
        more rows than the tokenizer has ids is accepted only with its own tokenizer (HF checkpoints
        pad the embedding, e.g. Qwen2.5's 151936 rows for 151665 ids) or with the vocabulary of a model
        already accepted (the reference of a padded actor): anything else would sample ids the
        tokenizer cannot decode, mid-rollout. Length: the longest sequence the run feeds the model
        (`max_length` tokens, named by `length_what`) must fit its positions.
        """
        config, tok = model.config, self.tokenizer
        where = f"{key} {path!r}" if path else key
        try:
            check_vocab(tok, config.vocab_size, where)
        except ValueError as exc:
            raise ModelError(str(exc)) from exc
        tok_path = getattr(tok, "path", None)
        own = (tok_path is not None and path is not None and
               os.path.realpath(tok_path if os.path.isdir(tok_path) else os.path.dirname(tok_path))
               == os.path.realpath(path))
        if config.vocab_size > tok.vocab_size and not own and config.vocab_size not in self._accepted_vocab:
            raise ModelError(f"tokenizer ({tok.name}, {tok.vocab_size} ids) does not match {where} (vocab_size "
                             f"{config.vocab_size}) and is not that model's own tokenizer: the model would sample ids "
                             f"the tokenizer cannot decode. Use the model's tokenizer (data.tokenizer.path) or a model "
                             f"built for this one")
        self._accepted_vocab.add(config.vocab_size)
        if max_length > config.max_position_embeddings:
            raise ModelError(f"{length_what} is {max_length} tokens but {key} has max_position_embeddings="
                             f"{config.max_position_embeddings}; lower the length limits")

    def register_state(self, key: str, value: Stateful) -> None:
        """Add `value` (a `Stateful` or a plain dict) to what every checkpoint holds, under `key`."""
        if key in self.state:
            raise ValueError(f"checkpoint state {key!r} is registered twice")
        self.state[key] = value

    def skip_update(self, reason: Literal["nan_skips", "empty_updates"], detail: str) -> None:
        """Count and warn about an update that did not happen in the current step (module doc)."""
        self.progress[reason] += 1
        self._skipped_in_step = True
        # progress["step"] counts finished steps: this is step + 1, as in metrics.jsonl and the checkpoints
        logger.warning("step %d: %s; skipping the update", self.progress["step"] + 1, detail)

    # ----- hooks

    def trained_models(self) -> list[tuple[str, Optional[str]]]:
        """(config key, HF folder or None) of every model the run trains and checkpoints, read from `self.cfg` before
        anything is built (for `checkpoint_bytes`)."""
        return []

    def free_keys(self) -> tuple[str, ...]:
        """Config keys besides `RUN_FREE_KEYS` this trainer may resume with changed (e.g. offload switches,
        which give identical results); every key must exist in the config."""
        return ()

    def train_step(self) -> dict[str, float]:
        """One training step; returns its metrics, already reduced over ranks (same on every rank)."""
        raise NotImplementedError

    def policy_role(self) -> TrainableRole:
        """The role whose optimizer steps are the run's updates (the actor; the supervised policy): the loop
        counts the steps that moved it (module doc)."""
        raise NotImplementedError

    def evaluate(self) -> Optional[float]:
        """Held-out accuracy in [0, 1] (the same on every rank), or None when the run has no evaluation."""
        return None

    def eval_every(self) -> int:
        """Evaluate every N steps during training (0: only at the end, and before when `eval_before`)."""
        return 0

    def eval_prompts(self) -> int:
        """How many held-out prompts `evaluate` scores (for the closing table)."""
        return 0

    def eval_label(self) -> str:
        """The heading of the closing table."""
        return f"held-out accuracy ({self.eval_prompts()} prompts, greedy)"

    def export(self) -> Optional[str]:
        """Write the trained model in HF format to run_dir/hf; returns the folder."""
        return None

    def on_train_start(self) -> None:
        """After the checkpoint (if any) is loaded, before the first step: one-off work (e.g. caching reference scores)."""

    def prepare_checkpoint_io(self) -> None:
        """Bring everything a checkpoint reads or writes onto the device (roles with offloaded parts)."""

    def describe(self) -> str:
        """One log line about the run (data sizes, layout, roles) at the start of `train`."""
        return self.name

    # ----- the loop

    def _step(self) -> dict[str, float]:
        """`train_step`, then the step's classification and skip counters (module doc)."""
        policy = self.policy_role()
        before, self._skipped_in_step = policy.updates, False
        metrics = self.train_step()
        if policy.updates > before:
            self.progress["updates"] += 1
        elif self._skipped_in_step:
            self.progress["skipped_steps"] += 1
        self.progress["step"] += 1
        for reason in SKIP_REASONS:
            metrics[reason] = float(self.progress[reason])
        return metrics

    def _check_updates(self, ran: int) -> None:
        """SkippedUpdatesError when the policy never moved or skipped too many updates (module doc); `ran`: the
        steps this invocation ran. A finished run started again from a checkpoint written before the counters
        existed (`Counters`) ran and counted nothing, and has nothing to judge."""
        updates, skipped = self.progress["updates"], self.progress["skipped_steps"]
        never = not updates and (skipped or ran)
        if not never and skipped <= self.cfg.max_skipped_fraction * (updates + skipped):
            return
        why = ("the policy was never updated" if not updates else
               f"more than max_skipped_fraction={self.cfg.max_skipped_fraction} of the steps meant to update the "
               f"policy skipped their update")
        raise SkippedUpdatesError(
            f"{self.name}: {why}: updated in {update_summary(self.progress)}. The checkpoint of step "
            f"{self.progress['step']} is kept and nothing was exported; the warnings 'step N: ... skipping the "
            f"update' name the causes (a reward that is NaN, groups whose rewards all tie, ...)")

    def _save(self, step: int) -> None:
        self.prepare_checkpoint_io()
        with self.timer("checkpoint"):
            self.checkpoints.save(step, self.state, config=to_dict(self.cfg))

    def train(self) -> TrainResult:
        """Run (or resume) the whole training; every rank calls it. The run directory's lock is released however
        the run ends."""
        self.watchdog.start()
        try:
            return self._run()
        finally:
            self.watchdog.stop()
            if self.rank == 0:
                self.lock.release()

    def _run(self) -> TrainResult:
        with StopSignals() as signals:
            return self._run_until_done_or_stopped(signals)

    def _run_until_done_or_stopped(self, signals: StopSignals) -> TrainResult:
        cfg = self.cfg
        if self.resume_from is not None:
            self.prepare_checkpoint_io()
            self.checkpoints.load(self.resume_from, self.state)
            logger.info("resumed from %s at step %d", self.resume_from, self.progress["step"])
        logger.info("%s", self.describe())
        self.on_train_start()
        if self.eval_before and self.progress["step"] == 0:
            before = self.evaluate()
            self.progress["accuracy_before"] = -1.0 if before is None else before
        history: list[dict[str, float]] = []
        log = MetricsLogger(cfg.run_dir, rank=self.rank, tensorboard=cfg.tensorboard, progress_total=cfg.steps,
                            initial_step=self.progress["step"])
        clock = SaveClock(cfg.save_every_minutes)
        first_step = self.progress["step"]
        try:
            while self.progress["step"] < cfg.steps:
                metrics = self._step()
                step = self.progress["step"]
                every = self.eval_every()
                if every and step % every == 0 and step < cfg.steps:
                    accuracy = self.evaluate()
                    if accuracy is not None:
                        metrics["eval/accuracy"] = accuracy
                if step % cfg.log_every == 0 or step == cfg.steps:
                    log.log(step, metrics)
                    history.append({"step": step, **metrics})
                stop, due = agree_to_stop(signals, clock)
                if stop or due or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                    self._save(step)
                    clock.saved()
                if stop:
                    logger.warning("stopped by %s after step %d of %d, with its checkpoint; exiting with status %d "
                                   "(resume=auto continues)", signals.received or "a signal to another rank", step,
                                   cfg.steps, PREEMPTED_EXIT_STATUS)
                    raise Preempted()
            self._check_updates(self.progress["step"] - first_step)
            hf_path = self.export() if cfg.export_hf else None
            after = self.evaluate()
            if after is not None:
                log.log(self.progress["step"], {"eval/accuracy": after})
        finally:
            log.close()
        before = self.progress["accuracy_before"] if self.progress["accuracy_before"] >= 0 else None
        updates = update_summary(self.progress)
        if self.rank == 0:
            print(f"{self.name}: policy updated in {updates}" if after is None else
                  accuracy_table(before, after, self.progress["step"], self.eval_label(), self.name, updates), flush=True)
        return TrainResult(self.progress["step"], history, hf_path, before, after, self.progress["updates"])
