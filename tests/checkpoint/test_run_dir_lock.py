"""RunDirLock: who holds a run directory, and when a lock is stale (the trainers' use: tests/trainers/test_lifecycle.py)."""
import json
import os
import subprocess
import sys
import time

import pytest

from megalign.checkpoint import lock as lock_mod
from megalign.checkpoint import RunDirLock, RunDirLocked


def _write_lock(run_dir, age_s=0.0, **holder):
    """A lock file of `holder` (none: an empty file, as a crash between creating and writing it leaves) touched
    `age_s` seconds ago."""
    path = os.path.join(run_dir, lock_mod.LOCK_FILE)
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "w") as f:
        if holder:
            json.dump({"since": "2026-12-04T10:00:00+00:00", "restart": "0", "job": None, **holder}, f)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_on_this_host_keeps_the_lock_and_is_named(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, host=lock_mod.socket.gethostname(), pid=holder.pid,
                    start=lock_mod._process_start(holder.pid), job="77")
        with pytest.raises(RunDirLocked, match=rf"in use by host .*, pid {holder.pid}, job 77 \(since 2026-12-04"):
            RunDirLock(str(tmp_path)).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_stale_locks_are_taken_over(tmp_path, dead_pid, monkeypatch, caplog):
    host = lock_mod.socket.gethostname()
    cases = {  # name: (holder, age in seconds)
        "dead pid": (dict(host=host, pid=dead_pid, start=None), 0),
        "pid reused by another process": (dict(host=host, pid=os.getpid(), start="1"), 0),
        "another host, silent for longer than STALE_AFTER_S": (dict(host="elsewhere", pid=1), lock_mod.STALE_AFTER_S + 1),
        "earlier incarnation of this requeued Slurm job": (dict(host="elsewhere", pid=1, job="99", restart="0"), 0),
        "unreadable, left by a crash": ({}, lock_mod.UNREADABLE_AFTER_S + 1),
    }
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    for name, (holder, age) in cases.items():
        run_dir = str(tmp_path / name.replace(" ", "_"))
        path = _write_lock(run_dir, age, **holder)
        lock = RunDirLock(run_dir)
        lock.acquire()
        with open(path) as f:
            assert json.load(f)["token"] == lock.me["token"], name
        lock.release()
        assert not os.path.exists(path), name
    assert caplog.text.count("taking over the lock") == len(cases)


def test_live_locks_of_other_hosts_and_jobs_are_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    for name, holder in {"another host, heartbeat fresh": dict(host="elsewhere", pid=1, job="5"),
                         "another step of this Slurm job": dict(host="elsewhere", pid=1, job="99", restart="0")}.items():
        _write_lock(str(tmp_path / name.replace(" ", "_")), 60, **holder)
        with pytest.raises(RunDirLocked, match="host elsewhere, pid 1"):
            RunDirLock(str(tmp_path / name.replace(" ", "_"))).acquire()
    _write_lock(str(tmp_path / "young"), 0)  # being written right now: not stale yet
    with pytest.raises(RunDirLocked, match="a job whose lock file is still being written"):
        RunDirLock(str(tmp_path / "young")).acquire()


def test_heartbeat_refreshes_the_lock_and_release_leaves_a_successor_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_mod, "HEARTBEAT_S", 0.02)
    first = RunDirLock(str(tmp_path))
    first.acquire()
    path = os.path.join(tmp_path, lock_mod.LOCK_FILE)
    os.utime(path, (0, 0))
    deadline = time.monotonic() + 30
    while os.stat(path).st_mtime == 0:
        assert time.monotonic() < deadline, "the heartbeat never touched the lock"
        time.sleep(0.02)
    second = RunDirLock(str(tmp_path))
    second.acquire()  # taken over from this same process (an earlier trainer that never released)
    first.release()
    with open(path) as f:
        assert json.load(f)["token"] == second.me["token"]  # the successor's lock stays
    second.release()
    assert not os.path.exists(path)
