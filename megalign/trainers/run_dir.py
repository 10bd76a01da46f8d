"""The run directory at start-up: the resume checks (config and data files), checkpoints the run does not continue,
room for a checkpoint, and which derived state a resume recomputes.

`Trainer.__init__` calls these in order, before any model is built, so a wrong start fails in seconds
and not at the first save hours later:

- `check_resume`: the checkpoint's config against this run's (`megalign.checkpoint.check_resume_config`:
  keys outside `RUN_FREE_KEYS` and the trainer's `free_keys()`) and the fingerprints of its data files
  against the files now (`megalign.checkpoint.check_resume_data`): a change is an error unless
  `resume_changes=allow`; the allowed changes are returned as dotted config keys (a changed data file as
  the key that names it, `data.path`).
- `claim_checkpoints`: checkpoints in run_dir that the run does not continue (another run's) refuse the
  start, unless `overwrite_checkpoints` deletes them.
- `check_run_dir`: run_dir/checkpoints must take a file and have room for one checkpoint
  (`checkpoint_bytes`: `CHECKPOINT_BYTES_PER_PARAM` per trained parameter).
- `stale_state`: the state a trainer registered as derived from parts of the config (a cache of reference
  scores: from the data and the reference) is not loaded when the resume changed one of those parts or
  the checkpoint lacks it; the trainer recomputes it.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Any, Collection, Mapping, Optional

from megalign.checkpoint import CheckpointManager, check_resume_config, check_resume_data, with_defaults
from megalign.config import ConfigError, key_is_under, to_dict
from megalign.plan.model import load_model, total_params
from megalign.trainers.run_config import RunConfig

logger = logging.getLogger(__name__)

CHECKPOINT_BYTES_PER_PARAM = 12
"""What a checkpoint holds per trained parameter: its fp32 value and Adam's two fp32 moments."""


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below one GiB (a tiny model's checkpoint is not "0.00 GiB")."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def check_resume(checkpoints: CheckpointManager, resume_from: str, cfg: RunConfig, free_keys: Collection[str],
                 data_files: Mapping[str, Any]) -> list[str]:
    """The dotted config keys a resume from `resume_from` changes, allowed by `resume_changes=allow` (module doc);
    ConfigError naming the changed keys or data files otherwise. `data_files`: this run's fingerprints
    (`megalign.checkpoint.fingerprint_files`). Every rank calls it with the same arguments, so all raise together."""
    allow = cfg.resume_changes == "allow"
    saved = with_defaults(type(cfg), checkpoints.saved_config(resume_from))
    changed = check_resume_config(saved, to_dict(cfg), free_keys, allow, checkpoint=resume_from)
    return changed + check_resume_data(checkpoints.saved_data_files(resume_from), data_files, allow,
                                       checkpoint=resume_from)


def stale_state(derived: Mapping[str, Collection[str]], changed: Collection[str],
                saved: Collection[str]) -> dict[str, str]:
    """{state key: why} of the derived state a resume must not load (module doc): `derived` maps a state key to the
    dotted config prefixes it is computed from, `changed` holds the keys the resume changed (`check_resume`),
    `saved` the state names the checkpoint holds."""
    stale = {}
    for key, sources in derived.items():
        hits = [k for k in changed if any(key_is_under(k, source) for source in sources)]
        if key not in saved:
            stale[key] = "the checkpoint holds none"
        elif hits:
            stale[key] = f"it is computed from {', '.join(sources)}, and the resume changed {', '.join(hits)}"
    return stale


def claim_checkpoints(checkpoints: CheckpointManager, resume_from: Optional[str], cfg: RunConfig) -> None:
    """Refuse to start beside checkpoints this run does not continue, or delete them (`overwrite_checkpoints`)."""
    others = checkpoints.not_continued(resume_from)
    if not others:
        return
    start = "from scratch" if resume_from is None else f"from {resume_from}"
    listed = ", ".join(map(str, others))
    if not cfg.overwrite_checkpoints:
        raise ConfigError(
            f"resume={cfg.resume!r} starts {start}, but {checkpoints.dir} holds checkpoints this run "
            f"does not continue (steps {listed}): its saves would mix with them, pruning would delete its own and "
            f"resume=auto would continue them. Set resume=auto to continue them, overwrite_checkpoints=true to "
            f"delete them first, or another run_dir", key="resume")
    logger.warning("overwrite_checkpoints=true: deleting the checkpoints of steps %s in %s (the run starts %s)",
                   listed, checkpoints.dir, start)
    checkpoints.delete(others)


def checkpoint_bytes(trained_models: Collection[tuple[str, Optional[str]]]) -> int:
    """About how many bytes one checkpoint takes, from the config alone (no model is built yet): every trained
    model's parameter count (`Trainer.trained_models`: (config key, HF folder or None), read from its config.json
    by the planner) times `CHECKPOINT_BYTES_PER_PARAM`. Models whose folder is missing are left to their own
    start-up check."""
    total = 0
    for _, path in trained_models:
        if path is not None and os.path.isfile(os.path.join(path, "config.json")):
            total += total_params(load_model(path)) * CHECKPOINT_BYTES_PER_PARAM
    return total


def check_run_dir(checkpoints: CheckpointManager, run_dir: str,
                  trained_models: Collection[tuple[str, Optional[str]]]) -> None:
    """ConfigError naming run_dir unless its checkpoints folder takes a file and has room for one checkpoint of
    `trained_models` (`checkpoint_bytes`), so an unwritable or full disk stops the start, not the first save."""
    folder = checkpoints.dir
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-test.{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"megalign")
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"run_dir={run_dir!r}: cannot write checkpoints in {folder}: "
                          f"{os.strerror(exc.errno) if exc.errno else exc} ({errno.errorcode.get(exc.errno, '?')}"
                          f"{f', {exc.filename}' if exc.filename else ''})", key="run_dir") from exc
    need, free = checkpoint_bytes(trained_models), shutil.disk_usage(folder).free
    if need > free:
        raise ConfigError(f"run_dir={run_dir!r}: {folder} has {_size(free)} free, but one "
                          f"checkpoint of this run takes about {_size(need)} ({CHECKPOINT_BYTES_PER_PARAM} "
                          f"bytes per trained parameter); free space or use another run_dir", key="run_dir")
