"""Side-by-side measurement helpers for benchmarks/: median wall time and peak extra memory.

Time: `median_time(fn)` runs fn after warm-up and returns the median seconds of `repeats` runs;
`median_times_interleaved({name: fn})` alternates several implementations within each repeat.

Memory on CPU: `peak_memory(factory, *args)` runs in a fresh spawned process. `factory(*args)`
builds the inputs and returns a zero-argument callable; the child then resets the kernel's
peak-RSS counter (/proc/self/clear_refs), runs the callable once and reports VmHWM minus the RSS
before the run: the memory the computation needed beyond its inputs. glibc is told to serve
every allocation above 64 KiB with mmap so freed buffers leave RSS and cannot hide in the heap.
On CUDA it uses torch.cuda.max_memory_allocated in the same way.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_times_interleaved(fns: dict[str, Callable[[], object]], repeats: int = 5,
                             warmup: int = 1) -> dict[str, float]:
    """Median seconds of each fn, running them in turn each repeat (a, b, a, b, ...), so a change in
    the machine's load during the run hits every implementation alike."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(queue, factory, args, device):
    try:
        run = factory(*args)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            queue.put(torch.cuda.max_memory_allocated() - base)
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_kib("VmRSS")
        run()
        queue.put((_status_kib("VmHWM") - base) * 1024)
    except BaseException as exc:  # report to the parent instead of hanging it
        queue.put(exc)


def peak_memory(factory: Callable, *args, device: str = "cpu") -> int:
    """Bytes of memory `factory(*args)()` needed beyond its inputs, measured in a fresh process."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, factory, args, device))
    proc.start()
    result = queue.get()
    proc.join()
    if isinstance(result, BaseException):
        raise result
    return int(result)


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 / AVX2 (from /proc/cpuinfo)."""
    name, flags = platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)  # the last CPU's fields
        name = info.get("model name\t", name).strip()
        flags = set(info.get("flags\t\t", "").split())
    except OSError:
        pass
    units = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    return f"{name} ({units})"


def machine_line() -> str:
    """One line naming what a CPU benchmark ran on: CPU, the megalign kernels' vector ISA, torch."""
    from megalign.ops import _backend

    isa = _backend._C.cpu_isa() if _backend.HAVE_EXTENSION else "none (references)"
    return (f"CPU: {cpu_model()}; megalign CPU kernels: {isa}; torch {torch.__version__} "
            f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads")


@dataclass
class Row:
    """One measured implementation of one case; ratios are relative to megalign in the same case."""

    op: str
    case: str
    impl: str
    seconds: float
    peak_bytes: int | None = None


def format_table(rows: list[Row], ours: str = "megalign") -> str:
    """Markdown table with time and memory ratios of each peer over megalign (higher = megalign wins)."""
    base = {(r.op, r.case): r for r in rows if r.impl == ours}
    out = ["| op | case | impl | time (ms) | time / megalign | peak extra (MiB) | mem / megalign |",
           "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        b = base.get((r.op, r.case))
        t_ratio = f"{r.seconds / b.seconds:.2f}x" if b else "-"
        mem = f"{r.peak_bytes / 2**20:.1f}" if r.peak_bytes is not None else "-"
        if b and r.peak_bytes is not None and b.peak_bytes:
            m_ratio = f"{r.peak_bytes / b.peak_bytes:.2f}x"
        else:
            m_ratio = "-"
        out.append(f"| {r.op} | {r.case} | {r.impl} | {r.seconds * 1e3:.2f} | {t_ratio} | {mem} | {m_ratio} |")
    return "\n".join(out)
