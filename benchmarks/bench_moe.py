"""MoE expert computation: grouped matmuls vs a loop over experts vs transformers' experts (issue 30), CPU.

One MoE layer's experts, forward + backward, on the same weights, tokens and routing (softmax top-k of a
random router): megalign's `GroupedExperts` through `torch._grouped_mm` (its default where the dtype and
16-byte row alignment allow), the same module forced onto its per-expert loop (its fallback), and
transformers' `Qwen3MoeExperts` (fused gate_up weights) in its two CPU implementations: `eager` (a Python
loop over the experts hit, `index_add_`) and `grouped_mm` (`config._experts_implementation`).
The outputs are first checked against megalign's grouped one; then median seconds of forward + backward,
interleaved (a, b, c, a, b, c, ...) so load changes hit all alike. Default shape: a quarter-width
Qwen3-30B-A3B layer (H = 512, expert width 192, E = 64, k = 8) on 2048 tokens, fp32 and bf16.

Run from the repository root: `PYTHONPATH=. python benchmarks/bench_moe.py [--tokens 2048 --experts 64]`.
"""
from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import machine_line, median_times_interleaved  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

from megalign.models import moe  # noqa: E402


def build(args, dtype):
    """(ours, {implementation: transformers'}, x, experts, weights, upstream gradient), the expert weights shared."""
    g = torch.Generator().manual_seed(0)
    e, h, f = args.experts, args.hidden, args.width
    ours = moe.GroupedExperts(e, h, f, tp_size=1)
    with torch.no_grad():
        for p in (ours.gate_proj, ours.up_proj, ours.down_proj):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ours.to(dtype)
    hf = {}
    for impl in ("eager", "grouped_mm"):
        config = Qwen3MoeConfig(num_experts=e, hidden_size=h, moe_intermediate_size=f)
        config._experts_implementation = impl
        hf[impl] = Qwen3MoeExperts(config)
        with torch.no_grad():
            hf[impl].gate_up_proj.copy_(torch.cat([ours.gate_proj, ours.up_proj], 1))
            hf[impl].down_proj.copy_(ours.down_proj)
    x = torch.randn(args.tokens, h, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(args.tokens, e, generator=g), -1)
    weights, chosen = torch.topk(probs, args.top_k, -1)
    up = torch.randn(args.tokens, h, generator=g).to(dtype)
    return ours, hf, x, chosen, weights, up


def step(module, x, chosen, weights, up, hf: bool):
    """Forward + backward of one peer; returns the output and the input gradient."""
    x = x.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x, chosen, weights.to(x.dtype) if hf else weights)
    (out.float() * up.float()).sum().backward()
    return out.detach(), x.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    print(f"tokens {args.tokens}, H {args.hidden}, expert width {args.width}, E {args.experts}, k {args.top_k}; "
          f"forward + backward, median of {args.repeats}")
    print("| dtype | megalign grouped (s) | megalign loop (s) | transformers eager (s) | transformers grouped_mm (s) |")
    print("|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        ours, hf, x, chosen, weights, up = build(args, dtype)
        assert moe._grouped_mm_ok(x, ours.down_proj), "the shape does not take the grouped path"

        def loop(*a):
            with mock.patch.object(moe, "_grouped_mm_ok", lambda *_: False):
                return step(ours, *a, hf=False)

        peers = {"grouped": lambda: step(ours, x, chosen, weights, up, hf=False),
                 "loop": lambda: loop(x, chosen, weights, up)}
        for impl, module in hf.items():
            module.to(dtype)
            peers[impl] = lambda m=module: step(m, x, chosen, weights, up, hf=True)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        ref = peers["grouped"]()
        for name, fn in peers.items():
            for a, b in zip(ref, fn()):
                torch.testing.assert_close(b.float(), a.float(), **tol, msg=lambda m: f"{dtype} {name}: {m}")
        t = median_times_interleaved(peers, repeats=args.repeats)
        cells = [f"{t[name]:.4f}" + ("" if name == "grouped" else f" ({t[name] / t['grouped']:.2f}x)")
                 for name in peers]
        print(f"| {str(dtype).split('.')[-1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
