"""Checkpoint write speed: `torch.distributed.checkpoint.save` of a model-sized state with one writer
thread (DCP's default) and with several (`FileSystemWriter(thread_count=...)`), side by side.

    python benchmarks/bench_checkpoint.py [--mib 2048] [--threads 1 2 4 8] [--dir /tmp/x] [--repeats 3]

The state is fp32 tensors shaped like a decoder's (one [V, H] embedding and [H, 4H] / [H, H]
blocks) adding up to --mib, plus an AdamW-like copy of each (exp_avg, exp_avg_sq) as a trainer's
checkpoint holds; each row of the output is the median over --repeats interleaved rounds of the
wall time of one save (written to --dir, then deleted), its GB/s, and its speed-up over one thread.
The page cache is not dropped between rounds (no privilege for it), so these are the rates of
writing into the cache and the file system behind it, as a trainer's save sees them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from harness import machine_line  # noqa: E402


def make_state(mib: int) -> dict:
    h = 1024
    per_block = 5 * h * h * 4  # [H, 4H] + [H, H] fp32
    n_blocks = max(1, (mib * 2 ** 20 // 3 - 32000 * h * 4) // per_block)
    g = torch.Generator().manual_seed(0)
    weights = {"embed": torch.randn(32000, h, generator=g)}
    for i in range(n_blocks):
        weights[f"layers.{i}.mlp"] = torch.randn(h, 4 * h, generator=g)
        weights[f"layers.{i}.attn"] = torch.randn(h, h, generator=g)
    optim = {f"{k}.{m}": torch.randn_like(v) for k, v in weights.items() for m in ("exp_avg", "exp_avg_sq")}
    return {"model": weights, "optim": optim}


def save_seconds(state: dict, root: str, threads: int) -> float:
    path = tempfile.mkdtemp(dir=root)
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))
    seconds = time.perf_counter() - t0
    shutil.rmtree(path)
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=2048, help="size of the state (weights + optimizer), MiB")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    root = args.dir or tempfile.mkdtemp()
    state = make_state(args.mib)
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    save_seconds(state, root, 1)  # warm-up: file-system metadata, allocator
    times = {n: [] for n in args.threads}
    for _ in range(args.repeats):
        for n in args.threads:
            times[n].append(save_seconds(state, root, n))
    print(machine_line())
    print(f"state {nbytes / 2 ** 30:.2f} GiB in {len(state['model']) * 3} tensors, written to {root}")
    print("| writer threads | seconds (median) | GB/s | vs 1 thread |")
    print("|---|---|---|---|")
    base = statistics.median(times[args.threads[0]])
    for n in args.threads:
        s = statistics.median(times[n])
        print(f"| {n} | {s:.2f} | {nbytes / s / 1e9:.2f} | {base / s:.2f}x |")


if __name__ == "__main__":
    main()
