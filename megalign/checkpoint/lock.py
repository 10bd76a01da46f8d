"""An exclusive lock on a run directory, so two jobs never write one run.

Two jobs on one run directory interleave their metrics, replace each other's config and checkpoints
(pruning deletes the other's) and one of them crashes late. So a trainer takes `run_dir/.lock` at
start-up, before it writes anything there, and a second job fails at once with a message naming the
first (host, pid, Slurm job, since when, last sign of life).

Design choices:

- The lock is a file created with O_CREAT | O_EXCL, which is atomic on local file systems and NFS
  (v3 and later), where the runs of a cluster live; `flock` is not shared between NFS clients on
  every mount. It holds JSON: host, pid, the process's start time (so a reused pid is not taken
  for the holder), the job id and Slurm's restart count, and the time it was taken.
- A lock whose holder is known to be gone is stale and is taken over (with a warning naming it):
  on the same host, its pid no longer runs that process; under the same Slurm job id with another
  restart count, it is an earlier incarnation of this requeued job (Slurm never runs two at once);
  from this very process, it is the leftover of an earlier trainer (a process trains one run at a
  time). From another host, nothing can be asked, so the holder proves it is alive: a daemon thread
  touches the file every `HEARTBEAT_S` seconds, and a lock untouched for `STALE_AFTER_S` is stale.
- Only rank 0 takes, refreshes and releases the lock; the trainer broadcasts the outcome so every
  rank fails together. `release` removes the file only while it is still this holder's.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Optional

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
"""The lock's name inside the run directory."""

HEARTBEAT_S = 60.0
"""How often the holder touches the lock file."""

STALE_AFTER_S = 600.0
"""A lock of another host untouched for this long has lost its holder (ten missed heartbeats)."""

UNREADABLE_AFTER_S = 10.0
"""A lock without a holder's JSON this long after it was created was left by a crash while it was written."""


class RunDirLocked(RuntimeError):
    """The run directory is held by another live job (the message names it)."""


def _process_start(pid: int) -> Optional[str]:
    """The start time of process `pid` in clock ticks since boot (/proc/PID/stat field 22), None when it does not run."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: Optional[str]) -> bool:
    """Whether process `pid` runs and, when `start` is known and /proc readable, is the one that started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now = _process_start(pid)
    return start is None or now is None or now == start


def holder_identity() -> dict[str, Any]:
    """Who this process is, as the lock records it (module doc)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
            "token": uuid.uuid4().hex,
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"),
            "restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def describe_holder(holder: dict[str, Any]) -> str:
    """"host h, pid p, job j (since ...)" of a lock's content."""
    if "host" not in holder:
        return "a job whose lock file is still being written"
    job = f", job {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job} (since {holder.get('since')})"


class RunDirLock:
    """The lock of one run directory (module doc): `acquire()` at start-up, `release()` at the end."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.me = holder_identity()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _stale_reason(self, holder: dict[str, Any], age_s: float) -> Optional[str]:
        """Why the lock of `holder` (last touched `age_s` ago) is stale, or None when its holder may be alive."""
        me = self.me
        if "host" not in holder:
            return "its content is unreadable (a crash while it was written)" if age_s > UNREADABLE_AFTER_S else None
        if holder.get("host") == me["host"]:
            if holder.get("pid") == me["pid"] and holder.get("start") == me["start"]:
                return "it was taken by this process for an earlier run"
            if not _alive(int(holder["pid"]), holder.get("start")):
                return "its process no longer runs"
        if me["job"] is not None and holder.get("job") == me["job"] and holder.get("restart") != me["restart"]:
            return f"it is from restart {holder.get('restart')} of this requeued job"
        if age_s > STALE_AFTER_S:
            return f"its holder has not refreshed it for {age_s:.0f} s"
        return None

    def _read(self) -> tuple[dict[str, Any], float]:
        """(the lock's content, seconds since it was last touched); unreadable content is an empty holder."""
        age = time.time() - os.stat(self.path).st_mtime
        try:
            with open(self.path, encoding="utf-8") as fh:
                holder = json.load(fh)
        except (OSError, ValueError):
            holder = {}
        return holder if isinstance(holder, dict) else {}, age

    def acquire(self) -> None:
        """Take the lock, or raise RunDirLocked naming the live holder. Creates the run directory."""
        os.makedirs(self.run_dir, exist_ok=True)
        text = json.dumps(self.me)
        for _ in range(3):  # a stale lock removed, then created again by a third job in between: look again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder, age = self._read()
                except FileNotFoundError:
                    continue  # released meanwhile
                reason = self._stale_reason(holder, age)
                if reason is None:
                    raise RunDirLocked(
                        f"run_dir {self.run_dir!r} is in use by {describe_holder(holder)}, last alive {age:.0f} s ago: "
                        f"two jobs on one run directory would interleave their metrics and replace each other's "
                        f"checkpoints. Use another run_dir, wait for that job, or, if it is gone, delete {self.path}"
                    ) from None
                logger.warning("taking over the lock %s of %s: %s", self.path, describe_holder(holder), reason)
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            self._thread = threading.Thread(target=self._heartbeat, name="run-dir-lock", daemon=True)
            self._thread.start()
            return
        raise RunDirLocked(f"run_dir {self.run_dir!r}: could not take {self.path}: other jobs keep taking it")

    def _owned(self) -> bool:
        try:
            holder, _ = self._read()
        except FileNotFoundError:
            return False
        return holder.get("token") == self.me["token"]

    def _heartbeat(self) -> None:
        """Touch the lock every HEARTBEAT_S while it is ours (module doc)."""
        while not self._stop.wait(HEARTBEAT_S):
            if not self._owned():
                return
            os.utime(self.path)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self._stop.set()
        if self._owned():
            os.unlink(self.path)
