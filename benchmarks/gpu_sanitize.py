"""Step 5 of benchmarks/gpu_check.sh: every megalign op, forward and backward, at the odd sizes where
an index goes wrong, small enough to run under compute-sanitizer in seconds.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/gpu_sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/gpu_sanitize.py --only gae token_logprob
    python benchmarks/gpu_sanitize.py --device cpu          (the same calls on the CPU kernels)

Run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor is its own allocation and a read
past one is outside any allocation (the caching allocator would hide it inside a larger block).
Sizes: vocabularies V = 1, 2, 7 and 1031 read through an offset slice (rows not 16-byte aligned,
row stride > V), N = 0 and 1 rows; GAE rows of T = 1 and 2049 (one past a scan tile); uneven
group ids with an empty id; masked ops on 0 x T, 1 x 1 and odd [B, T] with a non-contiguous view.
Each call's outputs are checked for shape and finiteness where they must be finite; the exit
status is non-zero when any call raises.
"""
from __future__ import annotations

import argparse
import sys
import traceback

import torch

from megalign.ops.gae import gae
from megalign.ops.group_advantages import group_advantages
from megalign.ops.kl_penalty import kl_penalty, kl_penalty_masked_mean
from megalign.ops.policy_loss import policy_loss
from megalign.ops.token_logprob import token_logprob, token_logprob_partials


def token_logprob_cases(device: str) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for v in (1, 2, 7, 1031):
            for n in (0, 1, 3):
                wide = torch.randn(n, v + 5, device=device).to(dtype)
                logits = wide[:, 1:1 + v]  # offset by one element: not 16-byte aligned, stride > V
                targets = torch.randint(0, v, (n,), device=device)
                if n > 1:
                    targets[1] = -100
                x = logits.detach().clone().requires_grad_(True)
                logp, ent = token_logprob(x[:, :], targets, return_entropy=True)
                (logp.sum() + ent.sum()).backward()
                assert logp.shape == (n,) and x.grad.shape == (n, v)
                assert torch.isfinite(logp).all() and torch.isfinite(x.grad.float()).all()
                token_logprob(logits, targets, temperature=0.7)
                token_logprob_partials(logits, targets, 0, vocab_size=v, with_entropy=True)


def gae_cases(device: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for b, t in ((0, 5), (1, 1), (3, 2049), (2, 1)):
            r, v = torch.randn(b, t, device=device).to(dtype), torch.randn(b, t, device=device).to(dtype)
            mask = torch.rand(b, t, device=device) < 0.7
            adv, ret = gae(r, v, mask, 0.99, 0.95)
            assert adv.shape == (b, t) and torch.isfinite(adv).all()
            gae(r.t().contiguous().t(), v, mask, 1.0, 0.0)  # strided rows


def group_cases(device: str) -> None:
    for n, size in ((1, 1), (7, 7), (48, 16)):
        scores = torch.randn(n, device=device)
        group_advantages(scores, group_size=size)
    ids = torch.tensor([5, 5, 9, 2, 9, 9, 40], device=device)  # uneven groups, sparse ids
    out = group_advantages(torch.randn(7, device=device), group_index=ids)
    assert out.shape == (7,) and torch.isfinite(out).all()
    group_advantages(torch.randn(0, device=device), group_index=torch.zeros(0, dtype=torch.long, device=device))


def masked_cases(device: str) -> None:
    for b, t in ((0, 4), (1, 1), (3, 7), (5, 1031)):
        base = torch.randn(b, t + 3, device=device)
        logp = (-base.abs())[:, 1:1 + t]  # non-contiguous view
        old, ref, adv = logp + 0.05, logp - 0.1, torch.randn(b, t, device=device)
        mask = torch.rand(b, t, device=device) < 0.6
        lp = logp.detach().clone().requires_grad_(True)
        kl_penalty(lp, ref, "k3").sum().backward()
        kl_penalty_masked_mean(lp, ref, mask).backward()
        loss, stats = policy_loss(lp, old, adv, mask, 0.2, 0.28, dual_clip=3.0, beta=0.01, ref_logp=ref)
        loss.sum().backward()
        policy_loss(lp, old, adv, mask.to(torch.uint8), reduction="mean")[0].backward()
        assert torch.isfinite(lp.grad).all() and torch.isfinite(stats.approx_kl)


CASES = {"token_logprob": token_logprob_cases, "gae": gae_cases, "group_advantages": group_cases,
         "masked": masked_cases}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", nargs="*", choices=sorted(CASES))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    failed = 0
    for name in args.only or CASES:
        try:
            CASES[name](args.device)
            if args.device == "cuda":
                torch.cuda.synchronize()
            print(f"gpu_sanitize: {name} ok", flush=True)
        except Exception:  # report every case: the sanitizer's own report names the kernel
            failed += 1
            print(f"gpu_sanitize: {name} FAILED\n{traceback.format_exc()}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
