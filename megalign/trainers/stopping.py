"""Stopping a run early without losing work: SIGTERM / SIGUSR1 on any rank, and time-based saves.

A job is told to stop by a signal: SIGTERM from Slurm's preemption, `scancel` or a spot instance's
reclaim (torchrun forwards its own SIGTERM to the workers), SIGUSR1 from `sbatch --signal` ahead of
the walltime (launch/slurm/*.sbatch). Killed by the default action, the run lost every step since the
last `save_every` checkpoint. Here the signal only raises a flag (`StopSignals`); the trainer's loop
acts on it at the end of the step:

- The ranks agree first. A signal reaches the ranks at different moments (or only some of them), so
  at every step boundary the flags are combined by one all-reduce (MAX) over the world
  (`agree_to_stop`); every rank then takes the same decision at the same step, finishing the step
  that was running and none after it, so no rank waits in a collective for one that left.
- Then it saves a checkpoint of that step and raises `Preempted`, a `SystemExit` with status 75
  (`PREEMPTED_EXIT_STATUS`, sysexits' EX_TEMPFAIL: "try again later"), distinct from a failure (1)
  or a config error (2), so a job script can requeue exactly these runs; `resume=auto` continues
  from the checkpoint as if nothing had happened.
- The same all-reduce carries the time-based save (`save_every_minutes`): each rank says whether
  that much time has passed since the last checkpoint by its clock, and a save happens when any
  rank says so, so clocks that disagree by a little never split the ranks.

The handlers are installed for the duration of `Trainer.train` only (the previous ones come back
after it), in the main thread (where Python runs signal handlers). A signal that arrives after the
last step (its checkpoint is written) lets the HF export and the final evaluation finish.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_STATUS = 75
"""The exit status of a run stopped by a signal after writing its checkpoint (module doc)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that stop a run at the end of its current step."""


class Preempted(SystemExit):
    """A run stopped by a signal after saving its checkpoint; exits the process with `PREEMPTED_EXIT_STATUS`."""

    def __init__(self):
        super().__init__(PREEMPTED_EXIT_STATUS)


class StopSignals:
    """A context in which SIGTERM and SIGUSR1 set `received` (the first one's name) instead of killing the process."""

    def __init__(self):
        self.received: Optional[str] = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        """Only note the signal: the loop acts on it (and logs it) at the end of the step."""
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            logger.warning("training outside the main thread: SIGTERM / SIGUSR1 keep their default action (no "
                           "checkpoint on preemption)")
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class SaveClock:
    """When the last checkpoint was written, for `save_every_minutes` (0: never due)."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60.0
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.last >= self.seconds

    def saved(self) -> None:
        self.last = time.monotonic()


def agree_to_stop(signals: StopSignals, clock: SaveClock) -> tuple[bool, bool]:
    """(stop, save) decided by every rank together: any rank's signal stops all, any rank's due clock saves all.

    A collective over the world (module doc); a CPU tensor, which gloo reduces also beside NCCL.
    """
    flags = torch.tensor([float(signals.received is not None), float(clock.due())])
    if dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1])
