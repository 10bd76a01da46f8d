"""What a checkpoint records about the data files a run reads, and the resume check that they did not change.

A data file changed under the same path since the checkpoint would resume silently: the run mixes two
datasets, and keeps what it derived from the old rows (a DPO run's cached reference log-probs: swapped
pairs flip the sign of their margins). So every checkpoint holds a fingerprint of every data file
(`CheckpointManager.save(..., data_files=...)` writes `data_files.json` into the folder), and before
loading, a trainer calls

    current = fingerprint_files({"data.path": cfg.data.path, "data.eval_path": cfg.data.eval_path})
    changed = check_resume_data(checkpoints.saved_data_files(path), current, allow=..., checkpoint=path)

Design choices:

- A file's fingerprint is its size in bytes, its modification time (ns) and a SHA-256 of its content:
  of the whole file up to `WHOLE_HASH_BYTES`, else of `SAMPLE_BLOCKS` blocks of `BLOCK_BYTES` spread
  evenly from its first byte to its last (the first and the last block included), so a resume reads
  at most 4 MiB of a file of any size. Blocks of bytes rather than rows: one rule for JSONL, Parquet
  and the Arrow shards of a `datasets` folder.
- A folder (a `datasets` save_to_disk folder) is every file under it, by relative path: a file
  added or removed is a change. A path that does not exist is recorded as missing (the data loader
  names it later); missing on one side only is a change.
- A file changed when its size or its hash differs. The modification time decides only where the hash
  does not cover the whole file: a small file that was touched or copied is unchanged (all of its
  content was compared), a large one with another time is changed even when its sampled blocks agree
  (an edit between them cannot be ruled out).
- Files are compared by the config key that names them (`data.path`); a key that names another path
  now is compared by content (a moved file is unchanged here; the config check reports the new path).
- A change is a `ConfigError` naming every changed file, its key and what differs, unless `allow`:
  then it is logged as a warning and the keys are returned, so the trainer recomputes what it derived
  from the data (`Trainer.register_state(..., derived_from=...)`). A checkpoint without
  `data_files.json` (written before fingerprints were recorded) resumes with a warning.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Mapping, Optional

from megalign.config import ConfigError

logger = logging.getLogger(__name__)

WHOLE_HASH_BYTES = 8 * 2**20
"""Files up to this size are hashed whole; larger ones by sampled blocks."""
SAMPLE_BLOCKS = 64
"""Blocks hashed of a larger file (the first and the last included)."""
BLOCK_BYTES = 64 * 2**10
"""Bytes per sampled block."""

Fingerprint = dict[str, Any]
"""One file: {"size": bytes, "mtime_ns": int, "sha256": hex digest, "whole": whether the hash covers all of it}."""


def fingerprint(path: str, whole_bytes: int = WHOLE_HASH_BYTES, blocks: int = SAMPLE_BLOCKS,
                block_bytes: int = BLOCK_BYTES) -> Fingerprint:
    """The fingerprint of one file (module doc): the SHA-256 of the whole file when it has at most `whole_bytes`
    bytes, else of `blocks` blocks of `block_bytes` at offsets round(i (size - block_bytes) / (blocks - 1))."""
    if blocks < 2 or block_bytes < 1:
        raise ValueError(f"blocks must be >= 2 and block_bytes >= 1, got {blocks}, {block_bytes}")
    stat = os.stat(path)
    digest = hashlib.sha256()
    whole = stat.st_size <= whole_bytes
    with open(path, "rb") as f:
        if whole:
            for chunk in iter(lambda: f.read(2**20), b""):
                digest.update(chunk)
        else:
            last = stat.st_size - block_bytes
            for i in range(blocks):
                f.seek(round(i * last / (blocks - 1)))
                digest.update(f.read(block_bytes))
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest(), "whole": whole}


def fingerprint_path(path: str) -> Optional[dict[str, Fingerprint]]:
    """{relative path ("" for a file): fingerprint} of a file or of every file under a folder; None when `path`
    does not exist."""
    if os.path.isfile(path):
        return {"": fingerprint(path)}
    if not os.path.isdir(path):
        return None
    files = {}
    for folder, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(folder, name)
            files[os.path.relpath(full, path)] = fingerprint(full)
    return files


def fingerprint_files(paths: Mapping[str, Optional[str]]) -> dict[str, dict[str, Any]]:
    """{config key: {"path": path, "files": `fingerprint_path(path)`}} of every key whose path is not None."""
    return {key: {"path": path, "files": fingerprint_path(path)} for key, path in paths.items() if path is not None}


def _file_change(old: Optional[Fingerprint], new: Optional[Fingerprint]) -> Optional[str]:
    """What differs between two fingerprints of one file (None: unchanged; module doc)."""
    if old is None or new is None:
        return "it is new" if old is None else "it no longer exists"
    reasons = []
    if old["size"] != new["size"]:
        reasons.append(f"size {old['size']} -> {new['size']} bytes")
    if old["sha256"] != new["sha256"]:
        reasons.append("content differs")
    if not reasons and not (old["whole"] and new["whole"]) and old["mtime_ns"] != new["mtime_ns"]:
        reasons.append("modified since (its sampled blocks agree, but they do not cover the whole file)")
    return ", ".join(reasons) or None


def data_file_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(config key, file, what differs) of every data file that changed between two `fingerprint_files` results."""
    changes = []
    for key in list(saved) + [k for k in current if k not in saved]:
        old, new = saved.get(key), current.get(key)
        path = (new or old)["path"]
        old_files, new_files = (None if entry is None else entry["files"] for entry in (old, new))
        if old_files is None or new_files is None:  # no such key, or no such path, on one side (or both)
            if old_files is not new_files:
                changes.append((key, path, "it is new" if old_files is None else "it no longer exists"))
            continue
        for rel in list(old_files) + [r for r in new_files if r not in old_files]:
            why = _file_change(old_files.get(rel), new_files.get(rel))
            if why is not None:
                changes.append((key, os.path.join(path, rel) if rel else path, why))
    return changes


def check_resume_data(saved: Optional[Mapping[str, Any]], current: Mapping[str, Any], allow: bool, *,
                      checkpoint: str = "the checkpoint", allow_key: str = "resume_changes=allow") -> list[str]:
    """The config keys whose data files changed since the checkpoint was written (module doc).

    saved: the checkpoint's fingerprints (`CheckpointManager.saved_data_files`), None when it has none;
    current: `fingerprint_files` of this run. Raises ConfigError naming every changed file, its key and what
    differs, and `allow_key`, when there are changes and not `allow`; with `allow` they are logged as a
    warning and their keys returned. Every rank calls it with the same fingerprints, so they raise together.
    """
    if saved is None:
        logger.warning("%s holds no data-file fingerprints (written before checkpoints recorded them): resuming "
                       "without checking that the data files are unchanged", checkpoint)
        return []
    changes = data_file_changes(saved, current)
    if not changes:
        return []
    listed = "; ".join(f"data file '{file}' ({key}) changed since {checkpoint} was written: {why}"
                       for key, file, why in changes)
    if not allow:
        raise ConfigError(f"resume: {listed}. Set {allow_key} to resume on the new data (what the run derived from "
                          f"the old rows, such as cached reference scores, is then recomputed), or resume=none to "
                          f"start afresh", key=changes[0][0])
    logger.warning("resuming with changed data (%s): %s", allow_key, listed)
    return sorted({key for key, _, _ in changes})
