"""Training metrics: a JSONL file, TensorBoard scalars and a progress bar, plus phase timers and memory.

Design choices:

- Rank 0 writes; other ranks' `MetricsLogger` is a no-op, so trainers call `.log` on every rank
  without branching (the values should already be reduced across ranks by the trainer).
- `metrics.jsonl` is the record of truth: one JSON object per `log` call, `{"step": N, ...}`,
  appended and flushed at once, so a crash loses at most the line being written. A run resumed from
  its checkpoint at step k (`resumed=True`) first removes the killed run's rows of steps after k, and
  a line the kill cut short, by writing the kept rows to a temporary file renamed over the old one,
  and logs how many it dropped: the resumed run logs those steps again, and a plot of the file then
  shows one trajectory, not the abandoned one beside it. TensorBoard's event files are append-only;
  its writer is opened with `purge_step=k + 1`, so TensorBoard hides the killed run's later events.
  TensorBoard and tqdm are conveniences: each is imported lazily and, when missing, disabled with one
  warning instead of stopping training. Weights & Biases and MLflow, when the run config's
  `logging.backends` lists them, get the same rows (`megalign.trainers.log_backends`: same names, same
  step, the config logged with the run, resumed runs continuing the same run id).
- Values may be Python numbers or 0-dim tensors; tensors are converted here, at log time, which is
  the one host sync per step that logging costs. Non-finite values are written as JSON `null`
  (JSON has no NaN), so the file stays valid for every parser.
- `PhaseTimer` accumulates wall-clock seconds per named phase (`with timer("update"): ...`),
  reported as `time/<phase>`; it synchronises CUDA at phase edges so GPU work is attributed to the
  phase that queued it. Its phase edges are also the progress the step watchdog watches
  (`megalign.trainers.watchdog`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from typing import Any, Iterator, Mapping, Optional, Union

import torch

from megalign.config import atomic_write_text
from megalign.trainers.log_backends import ExternalLoggers, LoggingConfig

logger = logging.getLogger(__name__)

Number = Union[int, float, torch.Tensor]

PROGRESS_KEYS = ("loss", "actor/loss", "reward/mean", "accuracy", "eval/accuracy", "lr", "grad_norm")
"""Metrics shown on the progress bar when present (the rest go only to the files): the loss (`loss`
for supervised trainers, `actor/loss` for RL), the reward and the accuracy, whichever trainer runs.
Each keeps its latest value, so a row with only `eval/accuracy` does not hide the loss."""


def _to_float(name: str, value: Number) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().float().cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"metric {name!r} must be a number or a 1-element tensor, got {type(value).__name__}")
    return float(value)


class MetricsLogger:
    """Per-step metrics to `run_dir/metrics.jsonl`, TensorBoard (`run_dir/tensorboard`) and a tqdm bar, on rank 0.

    Args:
        run_dir: the run directory (created if needed).
        rank: global rank; every rank but 0 logs nothing.
        tensorboard: also write TensorBoard scalars.
        progress_total: total steps for the progress bar; None for no bar.
        initial_step: steps already done (a resumed run), where the bar starts.
        resumed: the run resumes from its checkpoint at `initial_step`: the killed run's rows of later steps
            are removed from metrics.jsonl and hidden in TensorBoard (module doc).
        log_config: the run config's `logging` section (which backends, the run's name there); None: jsonl and
            TensorBoard. TensorBoard is written when `tensorboard` is true and `log_config` does not leave it out.
        config: the run's whole config as nested dicts (`megalign.config.to_dict`), logged with W&B / MLflow runs.
    """

    def __init__(self, run_dir: Union[str, os.PathLike], rank: int = 0, tensorboard: bool = True,
                 progress_total: Optional[int] = None, initial_step: int = 0, resumed: bool = False,
                 log_config: Optional[LoggingConfig] = None, config: Optional[Mapping[str, Any]] = None):
        self.enabled = rank == 0
        self.path = os.path.join(os.fspath(run_dir), "metrics.jsonl")
        self._file = self._writer = self._bar = self._external = None
        if not self.enabled:
            return
        os.makedirs(os.fspath(run_dir), exist_ok=True)
        if resumed:
            self._drop_rows_after(initial_step)
        if log_config is not None:  # first: a backend that cannot start leaves nothing open
            tensorboard = tensorboard and "tensorboard" in log_config.backends
            self._external = ExternalLoggers(log_config, os.fspath(run_dir), config, resumed)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # tensorboard is optional
                logger.warning("tensorboard is not installed (%s); metrics go to %s only", exc, self.path)
            else:
                self._writer = SummaryWriter(os.path.join(os.fspath(run_dir), "tensorboard"),
                                             purge_step=initial_step + 1 if resumed else None)
        if progress_total is not None:
            try:
                from tqdm import tqdm
            except ImportError as exc:
                logger.warning("tqdm is not installed (%s); no progress bar", exc)
            else:
                self._bar = tqdm(total=progress_total, initial=initial_step, dynamic_ncols=True, file=sys.stderr)
        self._last_step = initial_step
        self._shown: dict[str, str] = {}

    def _drop_rows_after(self, step: int) -> None:
        """Rewrite metrics.jsonl without the rows of steps after `step` and any line that is not a whole JSON row
        (a kill mid-write), atomically, and log the counts (module doc)."""
        if not os.path.isfile(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        kept, later, broken = [], 0, 0
        for line in lines:
            if not line.strip():
                continue
            try:
                row_step = json.loads(line)["step"]
            except (ValueError, TypeError, KeyError):
                broken += 1
                continue
            if row_step > step:
                later += 1
            else:
                kept.append(line)
        if later or broken:
            atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))
            logger.warning("%s: resuming at step %d, dropped %d rows of later steps logged by the interrupted run "
                           "and %d unreadable lines; kept %d rows", self.path, step, later, broken, len(kept))

    def log(self, step: int, metrics: Mapping[str, Number]) -> None:
        """Record `metrics` for `step` (all ranks call it; rank 0 writes)."""
        if not self.enabled:
            return
        values = {name: _to_float(name, value) for name, value in metrics.items()}
        row = {"step": int(step), **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(name, value, step)
        if self._external is not None:
            self._external.log(int(step), values)
        if self._bar is not None:  # postfix first: `update` redraws, so the bar is current at every step, the last too
            self._shown.update({k: f"{values[k]:.4g}" for k in PROGRESS_KEYS if k in values})
            self._bar.set_postfix({k: self._shown[k] for k in PROGRESS_KEYS if k in self._shown}, refresh=False)
            self._bar.update(max(0, step - self._last_step))
        self._last_step = max(self._last_step, step)

    def close(self) -> None:
        """Close every file and backend; W&B / MLflow runs are marked failed when an exception is propagating."""
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._external is not None:
            self._external.close()
        if self._file is not None:
            self._file.close()
        self._file = self._writer = self._bar = self._external = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PhaseTimer:
    """Wall-clock seconds per phase name, accumulated over `with timer("phase"):` blocks until `reset`.

    `watchdog` (a `megalign.trainers.watchdog.Watchdog`, or None) is told of every phase edge: the phases timed
    for the metrics are the progress it watches."""

    def __init__(self, watchdog=None):
        self.seconds: dict[str, float] = {}
        self.watchdog = watchdog

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.watchdog is not None:
            self.watchdog.enter(phase)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            if self.watchdog is not None:
                self.watchdog.leave(phase)

    def beat(self) -> None:
        """Progress inside a long phase of many batches, for the watchdog."""
        if self.watchdog is not None:
            self.watchdog.beat()

    def metrics(self, prefix: str = "time/") -> dict[str, float]:
        """{prefix + phase: seconds} accumulated so far."""
        return {f"{prefix}{phase}": s for phase, s in self.seconds.items()}

    def reset(self) -> None:
        self.seconds.clear()


def _current_rss_bytes() -> Optional[int]:
    """Resident set size of this process from /proc (Linux); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_report(prefix: str = "memory/") -> dict[str, float]:
    """This process's memory in GiB: host RSS and peak RSS; on CUDA also allocated, reserved and peak allocated.

    Peak RSS comes from `getrusage` (kilobytes on Linux), which the kernel updates lazily: it is
    raised to at least the current RSS so the two never disagree. CUDA numbers are for the current device.
    """
    gib = float(2**30)
    rss = _current_rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {f"{prefix}cpu_peak_rss_gib": max(peak, rss or 0) / gib}
    if rss is not None:
        out[f"{prefix}cpu_rss_gib"] = rss / gib
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{prefix}cuda_allocated_gib"] = torch.cuda.memory_allocated() / gib
        out[f"{prefix}cuda_reserved_gib"] = torch.cuda.memory_reserved() / gib
        out[f"{prefix}cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / gib
    return out
