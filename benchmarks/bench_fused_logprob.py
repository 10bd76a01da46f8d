"""Fused linear + log-prob vs the logits-then-log_softmax path: peak memory and time of forward+backward.

Case: final hidden states [N, H] and an LM head [V, H] (default N=4096 tokens, H=1024, V=151936,
Qwen2's vocabulary, fp32, one device); the loss is the sum of the target log-probs and both
gradients (hidden and head weight) are computed. Implementations:
  megalign      fused_linear_token_logprob, chunk_size tokens at a time: the only [tokens, vocab]
                temporary is one [chunk, V] logits chunk, recomputed in backward and overwritten by
                its gradient (Liger-Kernel's fused linear cross entropy scheme);
  torch eager   log_softmax(hidden @ W^T, -1).gather(-1, targets) with autograd: the [N, V] logits,
                their log-softmax (saved for backward) and in backward two [N, V] gradients.
Memory is the peak beyond the inputs, gradients included (every implementation must return the
[V, H] weight gradient, 594 MiB at the default size): the issue's target is megalign <= 25% of eager.

Run from the repository root: `PYTHONPATH=. python benchmarks/bench_fused_logprob.py [--quick]`
(`OMP_NUM_THREADS=1` gives steadier times on a loaded machine; the full size takes minutes on a CPU).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import Row, format_table, median_time, peak_memory  # noqa: E402

from megalign.parallel.logprob import fused_linear_token_logprob  # noqa: E402

IMPLS = ("megalign", "torch eager")


def _eager_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int):
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _fused_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int):
    return fused_linear_token_logprob(hidden, weight, targets, chunk_size=chunk_size)


def _make_step(impl: str, n: int, v: int, h: int, chunk_size: int):
    """Inputs for one case and a callable running forward + backward (module-level: spawn-safe)."""
    torch.manual_seed(0)
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) / h ** 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,))
    fn = _fused_logprob if impl == "megalign" else _eager_logprob

    def step():
        return torch.autograd.grad(fn(hidden, weight, targets, chunk_size).sum(), (hidden, weight))

    return step


def run(quick: bool = False, n: int = 4096, v: int = 151936, h: int = 1024, chunk_size: int = 1024) -> list[Row]:
    if quick:
        n, v, h, chunk_size = 256, 8192, 128, 64
    case = f"fwd+bwd N={n} V={v} H={h} fp32 chunk={chunk_size}"
    rows = []
    for impl in IMPLS:
        # One timed run at full size: each is tens of seconds of matmuls on a CPU.
        seconds = median_time(_make_step(impl, n, v, h, chunk_size), repeats=5 if quick else 1,
                              warmup=1 if quick else 0)
        peak = peak_memory(_make_step, impl, n, v, h, chunk_size)
        rows.append(Row("linear+logprob", case, impl, seconds, peak))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    args = parser.parse_args()
    print(format_table(run(quick=args.quick)))
