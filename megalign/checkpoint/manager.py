"""Atomic, resumable training checkpoints with `torch.distributed.checkpoint` (DCP), and the final HF export.

Layout of a run directory:

    run_dir/config.yaml                     the config of the latest start (earlier ones: config.<N>.yaml, see `resume`)
    run_dir/checkpoints/step_00000040/      a complete checkpoint (DCP files + .metadata, config.yaml, data_files.json)
    run_dir/checkpoints/step_00000050.tmp/  being written, or left behind by a crash: never read

Design choices:

- Atomicity by rename. Every rank writes its shards into `step_N.tmp`; DCP's save ends with the
  coordinator writing `.metadata` after gathering every rank's write results, then all ranks pass a
  barrier and rank 0 renames the folder to `step_N` (a directory rename is atomic on POSIX file
  systems), followed by a second barrier so no rank looks for the checkpoint before it exists. A
  crash at any point leaves at most a `.tmp` folder, which `latest_step` ignores and the next save
  of that step (or pruning) removes.
- Nothing non-finite is saved: `save` checks every floating-point tensor of the state first and
  raises naming the keys (on every rank together, so no rank is left waiting in a collective).
  Trainers skip such steps before they happen (`megalign.parallel.all_finite`); this check is the last line.
- One code path with and without `torch.distributed`: DCP runs without a process group in a single
  process (its `no_dist` mode, chosen automatically), and the barriers are skipped there.
- `keep_last` completed checkpoints are kept; older ones are deleted by rank 0 after a new one is
  complete, so a crash during pruning still leaves the newest checkpoint.
- `resolve_resume("auto" | "none" | step | path)` turns the `resume` config value into a folder,
  so trainers share one meaning of it; `not_continued` names the checkpoints a run starting there
  would not continue (another run's), which a trainer refuses to mix with its own.
- A checkpoint holds the resolved config it was written with (`save(..., config=to_dict(cfg))`
  writes `config.yaml` into the folder before the rename), so a resume can compare it with its own
  (`saved_config`, `megalign.checkpoint.resume.check_resume_config`), and the fingerprints of the data
  files the run read (`save(..., data_files=...)`, `saved_data_files`,
  `megalign.checkpoint.data_files.check_resume_data`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import logging
import warnings
from typing import Any, Iterator, Mapping, Optional, Union

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from megalign.checkpoint.state import Reshardable, SavedCheckpoint, nonfinite_keys
from megalign.checkpoint.write_errors import describe_write_failure
from megalign.config import ConfigError, atomic_write_text, config_yaml

_STEP_DIR = re.compile(r"step_(\d{8})")
logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
"""The resolved config inside a checkpoint folder."""
DATA_FILES = "data_files.json"
"""The fingerprints of the run's data files inside a checkpoint folder (`megalign.checkpoint.data_files`)."""

State = Mapping[str, Union[Stateful, Mapping[str, Any]]]
"""Top-level name -> a `Stateful` (model, optimizer, RNG, sampler) or a plain nested dict."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it "assumes a single process": without a process group that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


class CheckpointManager:
    """Saves, finds and loads the checkpoints of one run directory (rules in the module doc).

    Every method that writes or reads a checkpoint is collective when a process group exists:
    every rank calls it with the same step.
    """

    def __init__(self, run_dir: Union[str, os.PathLike], keep_last: int = 2, writer_threads: int = 4):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if writer_threads < 1:
            raise ValueError(f"writer_threads must be >= 1, got {writer_threads}")
        self.run_dir = os.fspath(run_dir)
        self.dir = os.path.join(self.run_dir, "checkpoints")
        self.keep_last = keep_last
        # DCP writes each rank's shards from one thread by default: 0.79 GB/s for a 2 GiB state on the
        # CPU machine, 0.35 GB/s on the H200 machine (a 12 GB PPO checkpoint took ~30 s); four
        # threads, each its own file, wrote 2.5x faster (benchmarks/bench_checkpoint.py, BENCHMARKS.md).
        self.writer_threads = writer_threads

    def _folder(self, checkpoint: Union[int, str, os.PathLike]) -> str:
        """The folder of a checkpoint given as a step number or a folder."""
        return self.path(checkpoint) if isinstance(checkpoint, int) else os.fspath(checkpoint)

    def path(self, step: int) -> str:
        """Folder of the completed checkpoint of `step`."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        return os.path.join(self.dir, f"step_{step:08d}")

    def _step_folders(self) -> list[int]:
        """Steps of every `step_N` folder, ascending, whole or not (`.tmp` folders are not checkpoints)."""
        if not os.path.isdir(self.dir):
            return []
        found = (_STEP_DIR.fullmatch(name) for name in os.listdir(self.dir))
        return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(self.dir, m.group(0))))

    def steps(self) -> list[int]:
        """Steps of the completed checkpoints, ascending: `step_N` folders that `damage` finds whole."""
        return [step for step in self._step_folders() if damage(self.path(step)) is None]

    def damaged(self) -> dict[int, str]:
        """{step: what is wrong} of the `step_N` folders that are not whole (truncated or emptied after the save:
        a copy cut short, a full disk, a file system repair)."""
        found = {step: damage(self.path(step)) for step in self._step_folders()}
        return {step: why for step, why in found.items() if why is not None}

    def latest_step(self) -> Optional[int]:
        """The newest completed checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: State, config: Any = None,
             data_files: Optional[Mapping[str, Any]] = None) -> str:
        """Write `state` as the checkpoint of `step` and return its folder.

        `Stateful` values are asked for their `state_dict()` once here. Raises ValueError, on every
        rank and before anything is written, when any rank's state holds NaN or inf. `config` (the
        run's resolved config, as `megalign.config.to_dict` gives it, or the config itself) is
        written by rank 0 as `config.yaml` in the folder, before it is renamed into place, and `data_files`
        (`megalign.checkpoint.data_files.fingerprint_files`) as `data_files.json`.
        """
        final = self.path(step)
        tmp = final + ".tmp"
        materialised = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        bad = nonfinite_keys(materialised)
        if _distributed():
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, bad)
            bad = [f"rank {r}: {key}" for r, keys in enumerate(everyone) for key in keys]
        if bad:
            raise ValueError(f"not saving checkpoint step {step} in {self.dir}: non-finite tensors {bad[:8]}"
                             f"{' ...' if len(bad) > 8 else ''}")
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed attempt at this step
            os.makedirs(tmp)
        _barrier()
        with _quiet_single_process():
            try:
                dcp.save(materialised, checkpoint_id=tmp,
                         storage_writer=dcp.FileSystemWriter(tmp, thread_count=self.writer_threads))
            except (OSError, RuntimeError, CheckpointException) as exc:  # name the file and the cause, not the zip pos
                raise describe_write_failure(exc, tmp, step) from exc
        if config is not None and _rank() == 0:
            atomic_write_text(os.path.join(tmp, CONFIG_FILE), config_yaml(config))
        if data_files is not None and _rank() == 0:
            atomic_write_text(os.path.join(tmp, DATA_FILES), json.dumps(data_files, indent=1, sort_keys=True))
        _barrier()
        if _rank() == 0:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        """Delete all but the newest `keep_last` checkpoints, and `.tmp` leftovers (rank 0 only; no save is in flight)."""
        for step in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.path(step), ignore_errors=True)
        for step, why in self.damaged().items():  # never loadable; a resume already fell back past it
            logger.warning("deleting the damaged checkpoint %s (%s)", self.path(step), why)
            shutil.rmtree(self.path(step), ignore_errors=True)
        for name in os.listdir(self.dir):
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def not_continued(self, resume_from: Optional[str]) -> list[int]:
        """Steps of this run's completed checkpoints that a run starting from `resume_from` does not continue.

        `resume_from`: a checkpoint folder (`resolve_resume`), or None for a run from scratch. A run
        from scratch, or from another run directory's checkpoint, continues none of them; a run from
        its own step N continues those up to N. The others belong to another run (or to an abandoned
        continuation of this one): its saves would mix with them, pruning (which keeps the highest
        steps) would delete its own, and a later `resume=auto` would pick theirs.
        """
        start = -1
        if resume_from is not None:
            folder = os.path.normpath(os.fspath(resume_from))
            match = _STEP_DIR.fullmatch(os.path.basename(folder))
            if match and os.path.realpath(os.path.dirname(folder)) == os.path.realpath(self.dir):
                start = int(match.group(1))
        return [step for step in self.steps() if step > start]

    def delete(self, steps: list[int]) -> None:
        """Remove the completed checkpoints of `steps` (rank 0 alone; nothing is being saved)."""
        for step in steps:
            shutil.rmtree(self.path(step))

    def load(self, checkpoint: Union[int, str, os.PathLike], state: State) -> None:
        """Restore `state` in place from a step number or a checkpoint folder.

        First every `Reshardable` value (model, optimizer, RNG) is shown the checkpoint's keys and
        says what to read (`load_target`), failing before anything is read when the checkpoint
        cannot be loaded into it (another tp or pp: the message names both layouts). DCP then fills
        the existing tensors, calls `load_state_dict` on the other `Stateful` values and replaces the
        non-tensor values of plain dicts; the `Reshardable`s get their filled targets. A key of
        `state` missing from the checkpoint (another model) raises naming the key.
        """
        path = self._folder(checkpoint)
        why = damage(path)
        if why is not None:
            raise FileNotFoundError(f"{path} is not a complete checkpoint: {why}")
        saved = SavedCheckpoint(path, frozenset(dcp.FileSystemReader(path).read_metadata().state_dict_metadata))
        targets = {name: value.load_target(name, saved) if isinstance(value, Reshardable) else value
                   for name, value in state.items()}
        with _quiet_single_process():
            dcp.load(targets, checkpoint_id=path)
        for name, value in state.items():
            if isinstance(value, Reshardable):
                value.load_state_dict(targets[name])

    def saved_config(self, checkpoint: Union[int, str, os.PathLike]) -> Optional[dict[str, Any]]:
        """The config a checkpoint (step or folder) was written with, as a plain dict; None when it holds none.

        Raises ConfigError naming the file when it is not a YAML mapping.
        """
        return self._saved_mapping(checkpoint, CONFIG_FILE, "checkpoint config", "YAML", yaml.safe_load, yaml.YAMLError)

    def saved_data_files(self, checkpoint: Union[int, str, os.PathLike]) -> Optional[dict[str, Any]]:
        """The fingerprints of the data files a checkpoint (step or folder) was written with; None when it holds none
        (written before they were recorded). Raises ConfigError naming the file when it is not a JSON object."""
        return self._saved_mapping(checkpoint, DATA_FILES, "checkpoint data-file fingerprints", "JSON", json.load,
                                   json.JSONDecodeError)

    def _saved_mapping(self, checkpoint: Union[int, str, os.PathLike], name: str, what: str, syntax: str,
                       parse: Any, errors: type[Exception]) -> Optional[dict[str, Any]]:
        """The mapping `parse` reads from file `name` of a checkpoint, None without that file; ConfigError naming
        the file (`what`) when it is not valid `syntax` (`parse` raises `errors`) or holds no mapping."""
        path = os.path.join(self._folder(checkpoint), name)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as fh:
                saved = parse(fh)
        except errors as exc:
            raise ConfigError(f"{what} {path!r} is not valid {syntax}: {' '.join(str(exc).split())}") from exc
        if not isinstance(saved, dict):
            raise ConfigError(f"{what} {path!r} must hold a mapping, got {type(saved).__name__}")
        return saved

    def saved_state_names(self, checkpoint: Union[int, str, os.PathLike]) -> frozenset[str]:
        """The top-level state names (`register_state` keys: "model", "optim", ...) a complete checkpoint holds."""
        metadata = dcp.FileSystemReader(self._folder(checkpoint)).read_metadata()
        return frozenset(key.split(".")[0] for key in metadata.state_dict_metadata)

    def resolve_resume(self, resume: Union[str, int]) -> Optional[str]:
        """The checkpoint folder to resume from, or None to start fresh.

        "auto": the latest completed checkpoint of this run, or None when there is none;
        "none": None; an int or a string of digits: that step of this run (must exist);
        anything else: a checkpoint folder path (must exist and be complete).
        """
        if resume == "none":
            return None
        if resume == "auto":
            step = self.latest_step()
            for bad, why in self.damaged().items():
                if step is None or bad > step:
                    logger.warning("resume=auto: the checkpoint %s is damaged (%s); resuming from %s instead",
                                   self.path(bad), why, "scratch" if step is None else self.path(step))
            return None if step is None else self.path(step)
        if isinstance(resume, int) or (isinstance(resume, str) and resume.isdigit()):
            path = self.path(int(resume))
        else:
            path = os.fspath(resume)
        why = damage(path)
        if why is not None:
            raise FileNotFoundError(f"resume={resume!r}: {path} is not a complete checkpoint ({why}); "
                                    f"completed steps in {self.dir}: {self.steps()}")
        return path


def damage(path: Union[str, os.PathLike]) -> Optional[str]:
    """None when the checkpoint folder `path` is whole, else what is wrong: no folder, no (or an unreadable)
    `.metadata`, or a data file missing or shorter than the bytes `.metadata` places in it (every rank's shards are
    listed there with their file, offset and length). Reads the metadata and stats the files: no tensor data."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return "no such folder"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return "no .metadata"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # a truncated pickle raises whatever unpickling stops on
        return f".metadata unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} missing"
        if os.path.getsize(file) < size:
            return f"{name} has {os.path.getsize(file)} bytes, .metadata places {size}"
    return None


def checkpoint_step(path: Union[str, os.PathLike]) -> int:
    """The step number of a checkpoint folder named `step_{N:08d}`."""
    match = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(os.fspath(path))))
    if match is None:
        raise ValueError(f"{os.fspath(path)} is not a checkpoint folder named step_NNNNNNNN")
    return int(match.group(1))
