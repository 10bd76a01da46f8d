"""What every launch script does before handing over to a trainer: argv, process group, logging.

`launch/train_<name>.py` is one call, `run_algorithm("<name>", sys.argv[1:])`, and the generic
`launch/train.py` is `run_algorithm(None, ...)`, which runs the algorithm the config names (its
`algorithm` key; `megalign.algos.registry`). Both end in `main(config_cls, train_fn, argv)`: parse
argv, load the typed config, initialise the process group and logging, run the trainer and tear the
group down.

Exit statuses: `--help` prints the usage and every config key of the trainer's config class (type,
default, doc; `megalign.config.config_help`), or for the generic entry the registered algorithms, on
stdout and exits 0. A bad command line, or a
`ConfigError` (unknown key, bad type, failed check, a refused resume with a changed config) prints one
line `error: ...` on stderr, naming the file and line or the override and the dotted key, and exits 2
(argparse's status for usage errors) instead of a traceback; so does a `LaunchError` (a launcher
variable missing or contradicting another, named in the line), and so do the other errors in what the
user gave, whose messages already name the file and row or the config key and folder (`INPUT_ERRORS`:
a bad data row, a model that does not fit the run or whose config.json cannot be used, a reward function spec). Errors about the run rather
than its input (`RUN_ERRORS`: the run directory locked by another job, a run whose policy never moved, a
checkpoint that could not be written, named with its file and cause)
print one line too and exit 1. A traceback repeated by every rank helps nobody there; `--debug` (or
the environment variable MEGALIGN_DEBUG=1) lets these errors raise with their traceback. Any other
failure raises as usual.

Design choice: a process group always exists. Under a launcher (torchrun, `srun` one task per GPU,
`mpirun` with mpi4py; `megalign.parallel.launch` reads and checks their variables) it is an env://
group; under plain `python` it is a one-rank group on an in-memory store (`HashStore`: nothing left on disk). So
the trainers have one code path (a `ParallelLayout`, ZeRO-1, DCP, collectives that return early on
one rank) whether they run on 1 process or 64, and nothing branches on "distributed or not".
Backend: gloo on CPU; on GPUs NCCL for CUDA tensors with gloo beside it for CPU tensors
("cuda:nccl,cpu:gloo"), which checkpoint and object collectives use.
"""
from __future__ import annotations

import datetime
import inspect
import logging
import os
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from megalign.algos.registry import ALGORITHMS, Algorithm
from megalign.algos.registry import get as get_algorithm
from megalign.algos.registry import load as load_algorithm
from megalign.checkpoint import RunDirLocked
from megalign.checkpoint.write_errors import CheckpointWriteError
from megalign.config import ConfigError, config_help, load_config
from megalign.data.prompts import DataError
from megalign.models.config import HFConfigError
from megalign.parallel.launch import LaunchError, cuda_device_index, resolve_launch
from megalign.parallel.placement import Split, init_side_group
from megalign.rewards import RewardSpecError
from megalign.trainers.base import ModelError, ModelPathError, SkippedUpdatesError
from megalign.trainers.disaggregated import rollout_ranks

C = TypeVar("C")

USAGE = "usage: [-h] [--debug] [--config CONFIG.yaml] [key.sub=value ...]"

DEBUG_ENV = "MEGALIGN_DEBUG"

SIDE_TIMEOUT = datetime.timedelta(minutes=30)
"""Collective timeout of a disaggregated job's side groups (torch's default for gloo and NCCL)."""
"""Set to 1 (or pass --debug) to see the traceback of the errors printed as one line (module doc)."""
INPUT_ERRORS = (DataError, ModelError, ModelPathError, HFConfigError, RewardSpecError)
"""Errors in the data, models or reward functions a config names: one line, exit status 2 (module doc)."""
RUN_ERRORS = (RunDirLocked, SkippedUpdatesError, CheckpointWriteError)
"""Errors about the run itself: one line, exit status 1 (module doc)."""


OPTIONS = ("  -h, --help            print this text and exit\n"
           "  --debug               show the traceback of data, model and run errors (also MEGALIGN_DEBUG=1)\n"
           "  --config CONFIG.yaml  YAML file of config keys (nested sections)\n"
           "  key.sub=value         set one config key (the value is YAML); applied after the file, in order\n")


def help_text(config_cls: type) -> str:
    """The `--help` text: usage, the config class's summary, the options, then every config key."""
    summary = (inspect.getdoc(config_cls) or config_cls.__name__).splitlines()[0]
    keys = "\n".join(f"  {line}" for line in config_help(config_cls).splitlines())
    return f"{USAGE}\n\n{summary}\n\n{OPTIONS}\nconfig keys of {config_cls.__name__}:\n{keys}"


def _roles(algo: Algorithm) -> str:
    reference = {True: ["reference"], False: []}.get(algo.reference, [f"reference when {algo.reference}"])
    trained = "actor" if algo.family == "online" else "model"
    return ", ".join([trained, *reference, *["critic"] * algo.critic, *["reward"] * algo.reward])


def algorithms_help() -> str:
    """The generic entry's `--help`: usage, the options, then every registered algorithm and its roles."""
    width = max(map(len, ALGORITHMS))
    rows = "\n".join(f"  {a.name:<{width}}  {a.summary} (roles: {_roles(a)})" for a in ALGORITHMS.values())
    return (f"{USAGE}\n\nTrain the algorithm a config names: its top-level `algorithm` key, or the override "
            f"algorithm=NAME.\n\n{OPTIONS}\nalgorithms (launch/train_NAME.py --help lists the config keys of one):\n"
            f"{rows}")


def _fail(message: str, status: int = 2) -> NoReturn:
    """Print `error: message` (one line) on stderr and exit with `status`.

    One `write` of the whole line: stderr is unbuffered (write-through), so `print` would issue the text and its
    newline as two writes, and two ranks failing at once on a shared pipe interleave into `...missingerror: ...`."""
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    raise SystemExit(status)


def parse_cli(argv: Sequence[str], config_cls: Optional[type] = None) -> tuple[Optional[str], list[str]]:
    """(`--config` path or None, ["key.sub=value", ...]) from argv.

    `-h` / `--help`: print `help_text(config_cls)` (without a class: `algorithms_help()`) and exit 0.
    Anything else that is not `--config PATH`, `--config=PATH` or `key=value`: one error line and
    the usage on stderr, exit 2.
    """
    config, overrides, args = None, [], list(argv)

    def bad(message: str) -> NoReturn:
        print(USAGE, file=sys.stderr)
        _fail(message)

    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(help_text(config_cls) if config_cls is not None else algorithms_help(), flush=True)
            raise SystemExit(0)
        if arg == "--debug":  # read by _train in this process; the environment is the one switch
            os.environ[DEBUG_ENV] = "1"
            continue
        if arg == "--config" or arg.startswith("--config="):
            if config is not None:
                bad("--config given twice")
            config = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else None)
            if not config:
                bad("--config needs a path")
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            bad(f"unexpected argument {arg!r}")
    return config, overrides


def init_distributed(device: str = "auto", rollout_ranks: int = 0) -> str:
    """Initialise the default process group (module doc) and return the device type, "cpu" or "cuda".

    `device`: "auto" (CUDA when available), "cpu" or "cuda". The launcher's environment is resolved
    and checked first (`resolve_launch`; a missing or contradictory variable is a `LaunchError` naming
    it); under Slurm or MPI its rank, world size, local rank and rendezvous are then exported as the
    torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so env:// and any code
    reading them see one launch. On CUDA the current device becomes the local rank (`cuda_device_index`).
    Does nothing but report the device type when a group already exists. `rollout_ranks` > 0 (a disaggregated
    online run, `megalign.parallel.placement`): the default group is this rank's side only, the job's last
    `rollout_ranks` ranks rolling out.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but CUDA is not available")
    launch = resolve_launch(os.environ)
    if launch.launcher in ("slurm", "mpi"):
        os.environ.update(launch.torchrun_env())
    if device_type == "cuda":
        torch.cuda.set_device(cuda_device_index(launch, torch.cuda.device_count()))
    if dist.is_initialized():
        return device_type
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
    if rollout_ranks:
        init_side_group(backend, Split(launch.rank, launch.world_size, rollout_ranks), SIDE_TIMEOUT)
    elif launch.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    return device_type


def setup_logging(rank: int) -> None:
    """INFO on rank 0, WARNING on the others (every rank still reports problems), with the rank in each line."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(config_cls: type[C], train_fn: Callable[[C], Any], argv: Sequence[str]) -> Any:
    """What every launch script runs: `[--config CONFIG.yaml] [key.sub=value ...]` -> `train_fn(config)`.

    The config is loaded (and checked) before the process group exists, so a bad key fails fast;
    the group is destroyed however `train_fn` ends. Returns what `train_fn` returns. `--help`, usage
    errors and `ConfigError`s (also those `train_fn` raises, e.g. a refused resume) end in SystemExit
    with the statuses of the module doc.
    """
    config_path, overrides = parse_cli(argv, config_cls)
    try:
        cfg = load_config(config_cls, config_path, overrides)
    except ConfigError as exc:
        _fail(str(exc))
    return _train(cfg, train_fn)


def on_rank0(fn: Callable[[C], Any]) -> Callable[[C], Any]:
    """`fn` as a `main` train_fn that runs on rank 0 only (a data writer: the files once, whatever the launcher),
    the other ranks waiting at a barrier for its files; returns `fn`'s result on rank 0, None elsewhere."""
    def run(cfg: C) -> Any:
        result = fn(cfg) if dist.get_rank() == 0 else None
        dist.barrier()
        return result

    return run


def run_algorithm(name: Optional[str], argv: Sequence[str]) -> Any:
    """`launch/train_<name>.py` (`name` given) or the generic `launch/train.py` (None: the algorithm the
    config names, `megalign.algos.registry.load`); then as `main`."""
    if name is not None:
        algo = get_algorithm(name)
        return main(algo.config_class(), algo.train_fn(), argv)
    config_path, overrides = parse_cli(argv)
    try:
        algo, cfg = load_algorithm(config_path, overrides)
    except ConfigError as exc:
        _fail(str(exc))
    return _train(cfg, algo.train_fn())


def _train(cfg: C, train_fn: Callable[[C], Any]) -> Any:
    """The process group, logging and `train_fn(cfg)` of a loaded config (`main`'s doc)."""
    try:
        init_distributed(cfg.device, rollout_ranks(cfg))
    except (LaunchError, ValueError) as exc:
        _fail(str(exc))
    setup_logging(resolve_launch(os.environ).rank)  # the job's rank: each side of a disaggregated job has a rank 0
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return train_fn(cfg)
    except ConfigError as exc:
        _fail(str(exc))
    except INPUT_ERRORS + RUN_ERRORS as exc:
        if debug:
            raise
        _fail(str(exc), 2 if isinstance(exc, INPUT_ERRORS) else 1)
    finally:
        dist.destroy_process_group()
