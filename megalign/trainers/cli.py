"""What every launch script does before handing over to a trainer: argv, process group, logging.

`launch/train_*.py` stay thin: `main(SFTConfig, train_sft, sys.argv[1:])` parses argv, loads the
typed config, initialises the process group and logging, runs the trainer and tears the group down.

Design choice: a process group always exists. Under `torchrun` (WORLD_SIZE set) it is the usual
env:// group; under plain `python` it is a one-rank group on a file store in a temporary folder. So
the trainers have one code path (a `ParallelLayout`, ZeRO-1, DCP, collectives that return early on
one rank) whether they run on 1 process or 64, and nothing branches on "distributed or not".
Backend: gloo on CPU; on GPUs NCCL for CUDA tensors with gloo beside it for CPU tensors
("cuda:nccl,cpu:gloo"), which checkpoint and object collectives use.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from megalign.config import load_config

C = TypeVar("C")


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """(`--config` path or None, ["key.sub=value", ...]) from argv; SystemExit with usage on anything else."""
    usage = "usage: [--config CONFIG.yaml] [key.sub=value ...]"
    config, overrides, args = None, [], list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            raise SystemExit(usage)
        if arg == "--config" or arg.startswith("--config="):
            if config is not None:
                raise SystemExit(f"--config given twice\n{usage}")
            config = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else None)
            if not config:
                raise SystemExit(f"--config needs a path\n{usage}")
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise SystemExit(f"unexpected argument {arg!r}\n{usage}")
    return config, overrides


def init_distributed(device: str = "auto") -> str:
    """Initialise the default process group (module doc) and return the device type, "cpu" or "cuda".

    `device`: "auto" (CUDA when available), "cpu" or "cuda". On CUDA the current device becomes
    LOCAL_RANK. Does nothing but report the device type when a group already exists.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but CUDA is not available")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if dist.is_initialized():
        return device_type
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        store = os.path.join(tempfile.mkdtemp(prefix="megalign-pg-"), "store")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
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
    the group is destroyed however `train_fn` ends. Returns what `train_fn` returns.
    """
    config_path, overrides = parse_cli(argv)
    cfg = load_config(config_cls, config_path, overrides)
    init_distributed(cfg.device)
    setup_logging(dist.get_rank())
    try:
        return train_fn(cfg)
    finally:
        dist.destroy_process_group()
