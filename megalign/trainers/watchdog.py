"""A step watchdog: a rank that makes no progress for `watchdog_minutes` ends the job, naming the phase it hung in.

Design choices:

- Progress is a phase edge: a `PhaseTimer` phase starting or ending (generate, reward, update,
  checkpoint, ...) or an explicit `beat()` inside a long phase of many batches (the reference cache).
  So a hung reward function, a deadlocked data loader or a collective waiting for a rank that died
  stops the run after the limit instead of sitting idle until the cluster's walltime, and the message
  says where (`phase 'reward' of step 3`, or `after phase 'update'` between phases) with every
  thread's stack (`faulthandler`), which is what a hang report needs.
- The watchdog is a daemon thread on every rank, and it ends its process with `os._exit`
  (`WATCHDOG_EXIT_STATUS`): a hung main thread cannot be interrupted by an exception, and `sys.exit`
  from another thread only ends that thread. The other ranks then go too: torchrun tears the whole
  job down when one worker exits non-zero, and without torchrun (srun, mpirun) each rank waiting in a
  collective for the dead one makes no progress either, so its own watchdog fires. The run
  directory's lock is left behind with a dead pid, which the next start takes over.
- The limit must exceed the longest phase the run has (a whole evaluation, a checkpoint of a large
  model); phases are timed per step, so the default (30 minutes, the torch.distributed default
  collective timeout) leaves room for big steps. 0 turns it off.
- A Python thread needs the GIL: C code that holds it forever stalls the watchdog too. Reward
  functions, the usual culprit, have their own timeout (`megalign.rewards.SafeReward`).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_STATUS = 124
"""Exit status of a rank the watchdog stopped: coreutils `timeout`'s, distinct from a failure (1), a config error
(2) and a preemption (75)."""


class Watchdog:
    """Ends the process when no phase edge or `beat` happened for `timeout_s` seconds while armed (module doc).

    Args:
        timeout_s: seconds without progress; 0 disables the watchdog (every method is then a no-op).
        step: returns the step being run (for the message).
        rank: this process's global rank (for the message).
    """

    def __init__(self, timeout_s: float, step: Callable[[], int], rank: int = 0):
        self.timeout_s = timeout_s
        self._step = step
        self._rank = rank
        self._phases: list[str] = []
        self._last_phase: Optional[str] = None
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Arm the watchdog (the loop's start); the clock starts now."""
        if not self.timeout_s or self._thread is not None:
            return
        self.beat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Disarm (the run ended, however); the thread exits at its next check."""
        self._stop.set()
        self._thread = None

    def beat(self) -> None:
        """Record progress inside a long phase (one batch of many)."""
        self._last_progress = time.monotonic()

    def enter(self, phase: str) -> None:
        self._phases.append(phase)
        self.beat()

    def leave(self, phase: str) -> None:
        if self._phases and self._phases[-1] == phase:
            self._phases.pop()
        self._last_phase = phase
        self.beat()

    def where(self) -> str:
        """The phase the rank is in, or the one it last left, and the step."""
        if self._phases:
            place = f"in phase {self._phases[-1]!r}"
        elif self._last_phase is not None:
            place = f"after phase {self._last_phase!r}, outside any timed phase"
        else:
            place = "before the first timed phase"
        return f"{place} of step {self._step()}"

    def _watch(self) -> None:
        stop = self._stop
        while not stop.wait(min(self.timeout_s / 4, 5.0)):
            idle = time.monotonic() - self._last_progress
            if idle > self.timeout_s:
                self._expire(idle)

    def _expire(self, idle: float) -> None:
        message = (f"rank {self._rank}: no progress for {idle / 60:.2f} minutes {self.where()} "
                   f"(watchdog_minutes={self.timeout_s / 60:g}); stopping the job with exit status "
                   f"{WATCHDOG_EXIT_STATUS}. Every thread's stack follows:")
        logger.error("%s", message)
        sys.stderr.write(f"error: {message}\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(WATCHDOG_EXIT_STATUS)
