"""Run a test body on several gloo/CPU processes (2 by default: the machines have 2 cores).

`run_distributed(fn, *args)` spawns the processes, initialises the default process group through a
file in a fresh temporary directory (no TCP port to race for), runs `fn(*args)` on every rank and
returns when all ranks finished. A failure on any rank fails the calling test with that rank's
traceback (`torch.multiprocessing.spawn` stops the other ranks), and a rank stuck in a collective
fails after `timeout_s` (gloo's collective timeout). `fn` must be a module-level function (it is
pickled); a spawn costs seconds, so one test runs several checks per spawn.
"""
from __future__ import annotations

import datetime
import os
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, timeout_s: float, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, *args, world_size: int = 2, timeout_s: float = 60.0) -> None:
    """Run `fn(*args)` on `world_size` gloo ranks; raise if any rank raises or exits abnormally."""
    with tempfile.TemporaryDirectory(prefix="megalign-dist-") as tmp:
        mp.spawn(
            _worker,
            args=(world_size, os.path.join(tmp, "rendezvous"), timeout_s, fn, args),
            nprocs=world_size,
            join=True,
        )
