"""Run a test body on several gloo/CPU processes (2 by default: the machines have 2 cores).

`run_distributed(fn, *args)` starts the processes, initialises the default process group through a
file in a fresh temporary directory (no TCP port to race for), runs `fn(*args)` on every rank and
returns when all ranks finished. When any rank fails, the test fails with a `RankFailure` carrying
the traceback of every rank that raised: the root cause is kept even when a peer's secondary error
("connection closed by peer") happens to be reported first. A rank stuck in a collective fails after
`timeout_s` (gloo's collective timeout).

Processes are forked: they inherit the imported torch and test module, which costs a fraction of a
second instead of seconds per spawn (torch's at-fork handler resets the intra-op thread pool, and
the parent never initialises a process group). Forked ranks must not use CUDA (the parent may have
initialised it); multi-rank tests here are gloo/CPU only. One test still runs several checks per start.
"""
from __future__ import annotations

import datetime
import glob
import os
import tempfile
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


class RankFailure(AssertionError):
    """One or more ranks of a `run_distributed` call failed; the message holds their tracebacks."""


def _worker(rank: int, world_size: int, tmp: str, timeout_s: float, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(*args)
        # the ranks leave together: a rank that is done (e.g. it raised an expected start-up error) and closes its
        # connections while a peer still connects a group of both makes the peer fail with "connection closed by peer"
        dist.barrier()
    except BaseException:
        # written before the process group closes, so it exists before any peer sees this rank go
        with open(os.path.join(tmp, f"rank{rank}.traceback"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, *args, world_size: int = 2, timeout_s: float = 60.0) -> None:
    """Run `fn(*args)` on `world_size` gloo ranks; raise `RankFailure` if any rank raises or dies."""
    with tempfile.TemporaryDirectory(prefix="megalign-dist-") as tmp:
        try:
            mp.start_processes(
                _worker, args=(world_size, tmp, timeout_s, fn, args), nprocs=world_size, join=True, start_method="fork"
            )
        except ProcessException as e:
            reports = []
            for path in sorted(glob.glob(os.path.join(tmp, "rank*.traceback"))):
                with open(path) as f:
                    reports.append(f"--- {os.path.basename(path).split('.')[0]}:\n{f.read()}")
            raise RankFailure(f"{len(reports)} of {world_size} ranks raised:\n" + "\n".join(reports or [str(e)])) from e
