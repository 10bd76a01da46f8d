"""What a resumed run checks and records about its config: the diff against the checkpoint's, and the run dir's history.

A run resumed with another config would silently mix two experiments in one run directory. So
every checkpoint holds the resolved config it was written with (`CheckpointManager.save(...,
config=to_dict(cfg))` puts `config.yaml` in the checkpoint folder), and before loading, a trainer calls

    changed = check_resume_config(checkpoints.saved_config(path), to_dict(cfg), FREE_KEYS,
                                  allow=cfg.resume_changes, checkpoint=path)

Design choices:

- The configs are compared as plain nested dicts (`megalign.config.to_dict`), key by key, down to
  the leaves of nested sections; a list is one value. A key present on one side only (a section
  that is None on one side) differs as `<absent>` on the other. A key added to the config class
  after the checkpoint was written is not a change while it keeps its default (new keys default to
  the old behaviour): `with_defaults` fills the saved config in before the comparison.
- `free_keys` are dotted prefixes of keys that may change without changing what the run computes
  (where it logs, how often it saves, where it runs). A prefix covers the key itself and everything
  inside it: "eval" covers "eval" and "eval.batch_size" (and "eval[0]"), but not "eval_path". A free
  key that names no key of either config is an error (a typo would otherwise free nothing).
- Any other difference is a `ConfigError` listing every changed key as `key: old -> new`, unless
  `allow`: then it is logged as a warning and the keys are returned (the run continues with the new
  values; the trainer's own lifecycle decides what that means, e.g. a new lr from the next step on).
- A checkpoint without a stored config (written before configs were stored) resumes with a warning
  that nothing could be checked.
- `write_run_config` keeps every config a run directory was started with: an existing `config.yaml`
  with other content is first copied to `config.<N>.yaml` (N = 1, 2, ... the next free number, so
  the numbers give the order), then the new one replaces `config.yaml`; each file is written
  atomically (`megalign.config.atomic_write_text`). A resume with the same config adds no file.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Collection, Mapping, Optional, Union

from megalign.config import ConfigError, atomic_write_text, config_yaml, from_dict, key_is_under, to_dict

logger = logging.getLogger(__name__)

_ABSENT = "<absent>"
"""How a key missing from one of the two configs is shown."""

_HISTORY = re.compile(r"config\.(\d+)\.yaml")


def _leaf_diff(old: Any, new: Any, prefix: str, out: list[tuple[str, Any, Any]], keys: set[str]) -> None:
    """Append (dotted key, old, new) for every leaf that differs; collect every dotted key seen in `keys`."""
    if prefix:
        keys.add(prefix)
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for key in list(old) + [k for k in new if k not in old]:
            _leaf_diff(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{prefix}.{key}" if prefix else str(key), out, keys)
    elif old != new:
        out.append((prefix, old, new))


def with_defaults(cls: type, saved: Optional[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
    """The checkpoint's config `saved` with every key `cls` gained since, at its default (module doc).

    A saved config that no longer loads into `cls` (a key since removed or renamed, a value now
    rejected) is returned as it is, so the comparison shows those keys as they were.
    """
    if saved is None:
        return None
    try:
        return to_dict(from_dict(cls, saved))
    except ConfigError:
        return saved


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any],
                   free_keys: Collection[str] = ()) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of every leaf that differs and is not under a free key (module doc)."""
    if isinstance(free_keys, str):
        raise TypeError(f"free_keys must be a collection of dotted keys, not one string {free_keys!r}")
    changes: list[tuple[str, Any, Any]] = []
    keys: set[str] = set()
    _leaf_diff(saved, current, "", changes, keys)
    unknown = [f for f in free_keys if not any(key_is_under(k, f) for k in keys)]
    if unknown:
        raise ValueError(f"free_keys {unknown} name no key of either config")
    return [c for c in changes if not any(key_is_under(c[0], f) for f in free_keys)]


def check_resume_config(saved: Optional[Mapping[str, Any]], current: Mapping[str, Any], free_keys: Collection[str],
                        allow: bool, *, checkpoint: str = "the checkpoint",
                        allow_key: str = "resume_changes=allow") -> list[str]:
    """The dotted keys whose values differ between the checkpoint's config and this run's (module doc).

    saved: the checkpoint's config (`CheckpointManager.saved_config`), None when it has none;
    current: `to_dict(cfg)` of this run; free_keys: dotted prefixes that may change; allow: resume
    despite changes (they are logged as a warning and returned). Raises ConfigError naming every
    changed key with its old and new value, and `allow_key` (the setting that allows it), when
    there are changes and not `allow`. Call it on every rank (they all read the same file, so they
    all raise together).
    """
    if saved is None:
        logger.warning("%s holds no config (written before checkpoints stored theirs): resuming without checking "
                       "that the config is unchanged", checkpoint)
        return []
    changes = config_changes(saved, current, free_keys)
    if not changes:
        return []
    listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes)
    if not allow:
        raise ConfigError(f"resume from {checkpoint}: the config differs from the one it was written with: {listed} "
                          f"(set {allow_key} to resume with these changes, or resume=none to start afresh)",
                          key=changes[0][0])
    logger.warning("resuming from %s with a changed config (%s): %s", checkpoint, allow_key, listed)
    return [key for key, _, _ in changes]


def write_run_config(run_dir: Union[str, os.PathLike], cfg: Any) -> str:
    """Write `cfg` (a config dataclass or its plain dict) to `run_dir/config.yaml`, keeping any other earlier one.

    An existing `config.yaml` with different content is first copied to `config.<N>.yaml`, N the
    next free number (module doc). Returns the path of `config.yaml`. Rank 0 alone calls it.
    """
    run_dir = os.fspath(run_dir)
    path = os.path.join(run_dir, "config.yaml")
    text = config_yaml(cfg)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            old = fh.read()
        if old == text:
            return path
        taken = [int(m.group(1)) for m in map(_HISTORY.fullmatch, os.listdir(run_dir)) if m]
        atomic_write_text(os.path.join(run_dir, f"config.{max(taken, default=0) + 1}.yaml"), old)
    atomic_write_text(path, text)
    return path
