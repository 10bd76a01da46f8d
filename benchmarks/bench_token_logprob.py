"""token_logprob forward+backward: megalign vs torch eager vs TRL's selective_log_softmax approach.

Case: logits [N, V] (default N=4096, V=151936, Qwen2's vocabulary, fp32) and a loss on the
target log-probs; time is forward + backward (the gradient w.r.t. the logits). Peers:
  torch eager   log_softmax(logits, -1).gather(-1, targets) with autograd (materialises [N, V]
                log-probs, and [N, V] gradients of them in backward);
  TRL loop      TRL's selective_log_softmax approach, re-written from its description: for
                fp32/fp64, gather the target logits and subtract a logsumexp computed row by row
                in a Python loop; for bf16/fp16, log_softmax row by row, then gather.
A forward-only case (N/4 rows) compares the forward with one torch.exp pass over the same logits
(into a preallocated output), the compute floor of a single pass that evaluates every e^z.
Memory is the peak beyond the inputs and the [N, V] gradient every implementation must return
(`peak_memory` minus the gradient's size), so the target "<= 5% of the logits' size" reads
directly off the column; megalign (inplace) writes the gradient into the logits buffer instead.

`python benchmarks/bench_token_logprob.py --gpu-bandwidth` reports the CUDA forward's HBM
bandwidth at N=8192, V=151936 bf16 as a fraction of MEGALIGN_HBM_GBPS (default 4800, H200).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import Row, format_table, machine_line, median_time, median_times_interleaved, peak_memory  # noqa: E402

from megalign.ops.token_logprob import token_logprob  # noqa: E402

IMPLS = ("megalign", "megalign (inplace)", "torch eager", "TRL loop")


def _trl_logprob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if logits.dtype in (torch.float32, torch.float64):
        selected = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return selected - lse
    rows = [torch.log_softmax(row, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
            for row, t in zip(logits, targets)]
    return torch.stack(rows)


def _loss_fn(impl: str):
    if impl == "megalign":
        return lambda x, t: token_logprob(x, t)
    if impl == "megalign (inplace)":
        return lambda x, t: token_logprob(x, t, inplace_backward=True)
    if impl == "torch eager":
        return lambda x, t: torch.log_softmax(x.float(), dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    if impl == "TRL loop":
        return _trl_logprob
    raise ValueError(f"unknown impl {impl!r}")


def _make_step(impl: str, n: int, v: int, dtype: str, device: str = "cpu"):
    """Inputs for one case and a callable running forward + backward (module-level: spawn-safe)."""
    torch.manual_seed(0)
    logits = torch.randn(n, v, dtype=getattr(torch, dtype), device=device)
    targets = torch.randint(0, v, (n,), device=device)
    fn = _loss_fn(impl)

    def step():
        x = logits.detach().requires_grad_()
        (grad,) = torch.autograd.grad(fn(x, targets).sum(), x)
        return grad

    return step


def forward_rows(n: int, v: int, dtype: str) -> list[Row]:
    """The forward alone (no autograd) against one torch.exp pass over the same logits: the compute
    floor of any single pass that evaluates every e^z (target: megalign within 1.5x of it)."""
    torch.manual_seed(0)
    logits = torch.randn(n, v, dtype=getattr(torch, dtype))
    targets = torch.randint(0, v, (n,))
    out = torch.empty_like(logits)
    case = f"fwd N={n} V={v} {dtype}"
    with torch.no_grad():
        times = median_times_interleaved({
            "megalign": lambda: token_logprob(logits, targets),
            "torch.exp over the logits (one pass)": lambda: torch.exp(logits, out=out),
            "torch eager `log_softmax().gather()`": lambda: torch.log_softmax(logits, -1).gather(-1, targets[:, None]),
        }, repeats=5)
    return [Row("token_logprob", case, impl, seconds) for impl, seconds in times.items()]


def run(quick: bool = False, n: int = 4096, v: int = 151936, dtype: str = "float32") -> list[Row]:
    if quick:
        n, v = 64, 4096
    rows = forward_rows(max(n // 4, 1), v, dtype)
    case = f"fwd+bwd N={n} V={v} {dtype}"
    grad_bytes = n * v * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # megalign and eager alternate within each repeat (load changes hit both alike); the TRL loop,
    # ~10x slower, is timed on its own. The in-place variant's later repeats run on the previous
    # repeat's gradient (finite values of the same shape), which costs the same as fresh logits.
    repeats = 3 if not quick else 5
    fast = [impl for impl in IMPLS if impl != "TRL loop"]
    times = median_times_interleaved({impl: _make_step(impl, n, v, dtype) for impl in fast}, repeats=repeats)
    times["TRL loop"] = median_time(_make_step("TRL loop", n, v, dtype), repeats=repeats)
    for impl in IMPLS:
        peak = peak_memory(_make_step, impl, n, v, dtype)
        extra = peak - (0 if impl == "megalign (inplace)" else grad_bytes)
        rows.append(Row("token_logprob", case, impl, times[impl], max(extra, 0)))
    return rows


def gpu_bandwidth(n: int = 8192, v: int = 151936) -> dict:
    """Achieved HBM bandwidth of the bf16 forward on CUDA and its fraction of MEGALIGN_HBM_GBPS."""
    if not torch.cuda.is_available():
        raise RuntimeError("gpu_bandwidth needs a CUDA device")
    logits = torch.randn(n, v, dtype=torch.bfloat16, device="cuda")
    targets = torch.randint(0, v, (n,), device="cuda")
    with torch.no_grad():
        seconds = median_time(lambda: token_logprob(logits, targets), repeats=20, warmup=3)
    moved = logits.numel() * logits.element_size() + n * (8 + 4)
    gbps = moved / seconds / 1e9
    peak = float(os.environ.get("MEGALIGN_HBM_GBPS", "4800"))
    return {"n": n, "v": v, "ms": seconds * 1e3, "GB/s": gbps, "peak GB/s": peak, "fraction": gbps / peak}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--gpu-bandwidth", action="store_true", help="CUDA forward bandwidth only")
    args = parser.parse_args()
    if args.gpu_bandwidth:
        print(gpu_bandwidth())
    else:
        print(machine_line())
        print(format_table(run(quick=args.quick)))
