"""The one trainer lifecycle every trainer runs on: torchtitan's shape, one `Trainer`, the algorithm in what it is given.

A trainer is a subclass that builds its tokenizer, data and roles in `__init__` (after the base has
set the run up), registers what a checkpoint must hold, and implements `train_step`; the base owns
the rest, so a new objective or role never copies the plumbing:

    start-up (`Trainer.__init__`): device -> the run directory's lock (`megalign.checkpoint.lock`: a
    second job on it fails here, naming the first) -> resume point resolved -> the data files fingerprinted
    (every `DataConfig`'s `path` / `eval_path`, `megalign.checkpoint.data_files`) -> the checkpoint's config
    and data fingerprints compared with this run's before any model is built (`run_dir.check_resume`: a
    change is an error unless `resume_changes=allow`) -> checkpoints in run_dir that the run does not
    continue refuse the start, unless `overwrite_checkpoints` deletes them -> run_dir/checkpoints must take
    a file and have room for one checkpoint -> run_dir/config.yaml (`write_run_config`: an earlier,
    different one is kept as config.<N>.yaml) -> every RNG seeded -> [subclass: tokenizer, data, roles,
    `register_state`]
    `train()`: load the checkpoint (less the derived state the resume recomputes) -> `on_train_start`
    -> evaluation before training (`eval_before`, once per run) -> loop { `train_step` -> metrics (file,
    TensorBoard, progress bar) -> evaluation every `eval_every()` steps -> the ranks agree on a stop signal
    and a time-based save (`megalign.trainers.stopping`) -> checkpoint every `save_every` steps, after
    `save_every_minutes`, on a signal (then exit with status 75) and after the last } -> the update check
    (`outcome.check_updates`) -> HF export -> final evaluation -> before/after table -> the lock released
    (also when the run fails). All of `train()` runs under the step watchdog (`megalign.trainers.watchdog`):
    a rank with no phase edge for `watchdog_minutes` ends the job naming the phase.

Design choices:

- Checkpoint state is a registry (`register_state(key, stateful)`): the base registers the RNG
  states and the progress counters, a trainer adds its models, optimizers, sampler and generators.
  Resume is exact because everything that a step reads is in there. State the trainer can compute
  again from parts of the config (a cache of reference scores over the training data) is registered
  with `derived_from`: a resume allowed to change one of those parts (a data file edited under the
  same path counts as a change of the key that names it) does not load it, and the trainer recomputes it.
- Skipped updates have one path: a role's `optimizer_step` decides (non-finite loss or gradient norm
  on any rank, `megalign.roles.actor.TrainableRole`), the trainer reports through `skip_update`,
  which warns with the step number and counts per reason in `progress` (`nan_skips`,
  `empty_updates`), so every trainer logs the same counters; the loop classifies every step by the
  trainer's `policy_role()` and a run that never trained fails (`megalign.trainers.outcome`).
- The progress bar shows `loss`, `reward/mean` and `accuracy` (`MetricsLogger.PROGRESS_KEYS`)
  whichever trainer runs, and is updated on every logged step including the last.

What the trainers share lives beside this module, and the names they import are also importable from here:
`run_config` (`RunConfig`, `DataConfig`, `RUN_FREE_KEYS`), `run_dir` (the start-up and resume checks),
`model_checks` (`check_model_path`, `check_stages`, `check_same_batch`, `ModelError`), `metric_sums`
(`MetricSums`: named sums, one all-reduce) and `outcome` (`TrainResult`, `SkippedUpdatesError`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Literal, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from megalign.checkpoint import CheckpointManager, Counters, RNGState, RunDirLock, fingerprint_files, write_run_config
from megalign.config import to_dict
from megalign.data import Tokenizer, TokenizerConfig, build_tokenizer
from megalign.models import ModelConfig
from megalign.parallel import ParallelLayout, StageSplit
from megalign.roles.actor import TrainableRole
from megalign.trainers.logging import MetricsLogger, PhaseTimer
from megalign.trainers.metric_sums import MetricSums
from megalign.trainers.model_checks import (ModelError, ModelPathError, check_model, check_model_path, check_same_batch,
                                            check_stages)
from megalign.trainers.outcome import (SKIP_REASONS, SkippedUpdatesError, TrainResult, accuracy_table, check_updates,
                                       update_summary)
from megalign.trainers.run_config import (RUN_FREE_KEYS, DataConfig, RunConfig, data_paths, resolve_device,
                                          seed_everything)
from megalign.trainers.run_dir import (CHECKPOINT_BYTES_PER_PARAM, check_resume, check_run_dir, claim_checkpoints,
                                       stale_state)
from megalign.trainers.stopping import PREEMPTED_EXIT_STATUS, Preempted, SaveClock, StopSignals, agree_to_stop
from megalign.trainers.watchdog import Watchdog

__all__ = [
    "Trainer", "RunConfig", "DataConfig", "RUN_FREE_KEYS", "resolve_device", "seed_everything", "MetricSums",
    "TrainResult", "SkippedUpdatesError", "SKIP_REASONS", "update_summary", "accuracy_table", "ModelError",
    "ModelPathError", "check_model_path", "check_stages", "check_same_batch", "CHECKPOINT_BYTES_PER_PARAM",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        self._layouts: dict[tuple[int, int, int], ParallelLayout] = {}  # by (tp, pp, ep)
        self._accepted_vocab: set[int] = set()
        self.lock = RunDirLock(cfg.run_dir)
        self.checkpoints = CheckpointManager(cfg.run_dir, keep_last=cfg.keep_last)
        self.resume_from, self.data_files, self.resume_changes = None, None, []
        if self.owns_run_dir():
            self._claim_run_dir(cfg)
        seed_everything(cfg.seed)
        self.progress: dict[str, Any] = {"step": 0, **dict.fromkeys(SKIP_REASONS, 0), "accuracy_before": -1.0,
                                         "updates": 0, "skipped_steps": 0}
        self.state: dict[str, Any] = {"rng": RNGState(), "progress": Counters(self.progress)}
        self._derived: dict[str, tuple[str, ...]] = {}
        self.watchdog = Watchdog(cfg.watchdog_minutes * 60, lambda: self.progress["step"] + 1, self.rank)
        self.timer = PhaseTimer(self.watchdog)
        self._skipped_in_step = False
        self.signals: Optional[StopSignals] = None  # while `train` runs

    def _claim_run_dir(self, cfg: RunConfig) -> None:
        """The run directory's part of start-up (module doc): lock, resume point, data fingerprints, resume checks,
        stale checkpoints, room, config.yaml."""
        self.on_rank0(self.lock.acquire)  # before anything is written there
        self.resume_from = self.checkpoints.resolve_resume(cfg.resume)
        self.data_files = self.on_rank0(lambda: fingerprint_files(data_paths(cfg)))  # read by one rank, kept by all
        self.resume_changes = [] if self.resume_from is None else check_resume(
            self.checkpoints, self.resume_from, cfg, RUN_FREE_KEYS + self.free_keys(), self.data_files)
        # after the resume checks: a refused resume deletes nothing; before any model is built: not at the first save
        self.on_rank0(lambda: claim_checkpoints(self.checkpoints, self.resume_from, cfg))
        self.on_rank0(lambda: check_run_dir(self.checkpoints, cfg.run_dir, self.trained_models()))
        if self.rank == 0:
            write_run_config(cfg.run_dir, cfg)  # after the check: a refused resume keeps the run's config.yaml

    def owns_run_dir(self) -> bool:
        """Whether this process's side of the job keeps the run directory (lock, checkpoints, config): every rank,
        except the rollout ranks of a disaggregated online run (`megalign.trainers.disaggregated`)."""
        return True

    # ----- set-up helpers for subclasses

    def on_rank0(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 alone (a decision about the run directory, a read of the data files), then return its
        result on every rank, or raise its error on every rank together, so no rank goes on to wait in a
        collective for one that failed."""
        box: list[Any] = [None, None]  # result, error
        if self.rank == 0:
            try:
                box[0] = fn()
            except Exception as exc:  # sent to every rank, raised there
                box[1] = exc
        dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            raise box[1]
        return box[0]

    def layout_for(self, tp: int, pp: int = 1, key: str = "model", stages: Optional[StageSplit] = None, ep: int = 1,
                   path: Optional[str] = None) -> ParallelLayout:
        """The layout with tensor-parallel size `tp`, `pp` pipeline stages (dp = world / (tp x pp)) and expert-parallel
        size `ep`, built once and shared by the roles that use it; `key` (the role's config key, e.g. "actor") names
        the settings in the error when tp x pp does not divide the world size or ep does not fit. `stages`: the
        role's layer split (`ModelRoleConfig.stage_split`), carried by the returned copy (same groups) to the model
        builders. `path`: the role's HF folder, whose config must be an MoE model whose num_experts ep divides when
        ep > 1 (checked before the model loads)."""
        world = dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(f"{key}.tp={tp} x {key}.pp={pp} = {tp * pp} does not divide the world size {world}: "
                             f"dp = world / (tp x pp) must be a whole number")
        if ep > 1:
            _check_experts(key, ep, world // (tp * pp), path)
        if (tp, pp, ep) not in self._layouts:
            self._layouts[tp, pp, ep] = ParallelLayout.build(tp=tp, pp=pp, ep=ep, device_type=self.device_type)
        return self._layouts[tp, pp, ep].with_stages(stages)

    def build_tokenizer(self, cfg: TokenizerConfig, model_path: Optional[str]) -> Tokenizer:
        """The run's tokenizer (`megalign.data.build_tokenizer`: by default the model folder's own, when it has one)."""
        self.tokenizer = build_tokenizer(cfg, model_path)
        return self.tokenizer

    def check_model(self, model, key: str, path: Optional[str], max_length: int, length_what: str) -> None:
        """Start-up checks of a model (from config key `key`, folder `path` or None) against the run's tokenizer and
        the models already accepted (`model_checks.check_model`)."""
        check_model(model, self.tokenizer, self._accepted_vocab, key, path, max_length, length_what)

    def register_state(self, key: str, value: Stateful, derived_from: tuple[str, ...] = ()) -> None:
        """Add `value` (a `Stateful` or a plain dict) to what every checkpoint holds, under `key`.

        `derived_from`: for state the trainer computes again whenever it was not loaded (a cache of reference
        scores), the dotted config keys (prefixes) it is computed from, e.g. ("data", "reference", "model.path").
        It is then not loaded, and stays as registered, when a resume allowed by `resume_changes=allow` changed
        one of those keys (a data file edited under the path a key names counts as a change of that key) or
        when the checkpoint holds none of it (`run_dir.stale_state`).
        """
        if key in self.state:
            raise ValueError(f"checkpoint state {key!r} is registered twice")
        if isinstance(derived_from, str):
            raise TypeError(f"derived_from must be a tuple of dotted config keys, not one string {derived_from!r}")
        unknown = [prefix for prefix in derived_from if not _names_a_key(to_dict(self.cfg), prefix)]
        if unknown:
            raise ValueError(f"derived_from of checkpoint state {key!r}: {unknown} name no key of the config")
        self.state[key] = value
        if derived_from:
            self._derived[key] = tuple(derived_from)

    def skip_update(self, reason: Literal["nan_skips", "empty_updates"], detail: str) -> None:
        """Count and warn about an update that did not happen in the current step (module doc)."""
        self.progress[reason] += 1
        self._skipped_in_step = True
        # progress["step"] counts finished steps: this is step + 1, as in metrics.jsonl and the checkpoints
        logger.warning("step %d: %s; skipping the update", self.progress["step"] + 1, detail)

    # ----- hooks

    def trained_models(self) -> list[tuple[str, Optional[str]]]:
        """(config key, HF folder or None) of every model the run trains and checkpoints, read from `self.cfg` before
        anything is built (for the room check of `run_dir.check_run_dir`)."""
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
        counts the steps that moved it (`megalign.trainers.outcome`)."""
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
        """`train_step`, then the step's classification and skip counters (`megalign.trainers.outcome`)."""
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

    def _load(self) -> None:
        """Load the resumed checkpoint into the registered state, less the derived state it must recompute."""
        stale = stale_state(self._derived, self.resume_changes, self.checkpoints.saved_state_names(self.resume_from))
        for key, why in stale.items():
            logger.warning("not loading %s from %s: %s; the trainer recomputes it", key, self.resume_from, why)
        self.prepare_checkpoint_io()
        self.checkpoints.load(self.resume_from, {k: v for k, v in self.state.items() if k not in stale})
        logger.info("resumed from %s at step %d", self.resume_from, self.progress["step"])

    def _save(self, step: int) -> None:
        self.prepare_checkpoint_io()
        with self.timer("checkpoint"):
            self.checkpoints.save(step, self.state, config=to_dict(self.cfg), data_files=self.data_files)

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
        with StopSignals() as self.signals:  # also where another part of the job reports a signal (`disaggregated`)
            return self._run_until_done_or_stopped(self.signals)

    def _run_until_done_or_stopped(self, signals: StopSignals) -> TrainResult:
        cfg = self.cfg
        if self.resume_from is not None:
            self._load()
        logger.info("%s", self.describe())
        self.on_train_start()
        if self.eval_before and self.progress["step"] == 0:
            before = self.evaluate()
            self.progress["accuracy_before"] = -1.0 if before is None else before
        history: list[dict[str, float]] = []
        log = MetricsLogger(cfg.run_dir, rank=self.rank, tensorboard=cfg.tensorboard, progress_total=cfg.steps,
                            initial_step=self.progress["step"], resumed=self.resume_from is not None,
                            log_config=cfg.logging, config=to_dict(cfg))
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
            check_updates(self.progress, self.progress["step"] - first_step, cfg.max_skipped_fraction, self.name)
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


def _check_experts(key: str, ep: int, dp: int, path: Optional[str]) -> None:
    """ValueError naming `key`.ep unless it divides `dp` and the experts of the MoE model in folder `path`."""
    if dp % ep:
        raise ValueError(f"{key}.ep={ep} must divide dp={dp} (world / ({key}.tp x {key}.pp)): the experts are split "
                         f"over groups of ep data-parallel ranks")
    if path is None:
        raise ValueError(f"{key}.ep={ep}: expert parallelism needs an MoE model from {key}.path (a model built from "
                         f"scratch is dense); set {key}.ep=1")
    check_model_path(path, f"{key}.path")
    experts = ModelConfig.from_hf(path).num_experts
    if experts == 0:
        raise ValueError(f"{key}.ep={ep}: {key}.path {path!r} is a dense model (no experts to split); set {key}.ep=1")
    if experts % ep:
        raise ValueError(f"{key}.ep={ep} must divide the {experts} experts of {key}.path {path!r}")


def _names_a_key(config: dict[str, Any], dotted: str) -> bool:
    """Whether `dotted` ("model.path") names a key of the nested config dict `config` (`to_dict`)."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
