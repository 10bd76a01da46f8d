"""Do CISPO and GSPO need a kernel? The pure-torch variants of `megalign.algos.policy_losses` beside the fused
`megalign.ops.policy_loss` (the "ppo" variant), and beside the log-prob computation that produces their input.

Cases (fp32, forward + backward to logp, aggregated as the trainers do: token-mean, seq-mean-token-mean for gspo):
  [B, T] = 64 x 4096 (quick: 4 x 256), 10% of the tokens masked; one time (median) per variant,
  the variants alternating within each repeat; peak extra memory of each in a fresh process.
  token_logprob: `megalign.ops.token_logprob` forward + backward over V = 32000 for 2048 tokens
  (quick: 256), reported per token beside the losses' per-token cost: what a loss costs against
  the computation it always follows.

A kernel pays off only if a variant costs a visible fraction of the log-prob step; the numbers in
BENCHMARKS.md ("Policy-loss variants") are the answer.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import Row, format_table, machine_line, median_time, median_times_interleaved, peak_memory  # noqa: E402

from megalign.algos.aggregation import aggregate_loss, loss_normalizer  # noqa: E402
from megalign.algos.policy_losses import POLICY_LOSSES  # noqa: E402
from megalign.ops.token_logprob import token_logprob  # noqa: E402

CLIP = {"ppo": (0.2, 0.28), "cispo": (None, 0.28), "gspo": (3e-4, 4e-4)}
AGG = {"ppo": "token-mean", "cispo": "token-mean", "gspo": "seq-mean-token-mean"}
VOCAB = 32000


def _inputs(b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + 0.01 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    mask = (torch.rand(b, t, generator=g) > 0.1).float()
    return logp.requires_grad_(), old, adv, mask


def _step(name, logp, old, adv, mask):
    logp.grad = None
    loss, _ = POLICY_LOSSES[name](logp, old, adv, mask, *CLIP[name])
    aggregate_loss(loss, mask, AGG[name], loss_normalizer(mask, AGG[name])).backward()


def _factory(name, b, t):
    inputs = _inputs(b, t)
    return lambda: _step(name, *inputs)


def _logprob_seconds(n: int) -> float:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, VOCAB, generator=g).requires_grad_()
    targets = torch.randint(0, VOCAB, (n,), generator=g)

    def step():
        logits.grad = None
        token_logprob(logits, targets).sum().backward()
    return median_time(step, repeats=5, warmup=1)


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    b, t = (4, 256) if quick else (64, 4096)
    steps = {}
    for name in POLICY_LOSSES:
        inputs = _inputs(b, t)
        steps[name] = (lambda name=name, inputs=inputs: _step(name, *inputs))
    times = median_times_interleaved(steps, repeats=5 if quick else 20, warmup=3)
    rows = [Row(op="policy loss", case=f"{b}x{t} fp32 fwd+bwd", impl="megalign" if name == "ppo" else name,
                seconds=times[name], peak_bytes=peak_memory(_factory, name, b, t)) for name in POLICY_LOSSES]
    n = 256 if quick else 2048
    per_token_logprob = _logprob_seconds(n) / n
    lines = [f"token_logprob fwd+bwd at V={VOCAB}: {per_token_logprob * 1e9:.0f} ns/token"]
    for name in POLICY_LOSSES:
        per_token = times[name] / (b * t)
        lines.append(f"{name}: {per_token * 1e9:.1f} ns/token = {per_token / per_token_logprob:.2%} of the log-prob's")
    return rows, lines


if __name__ == "__main__":
    print(machine_line())
    rows, lines = run(quick="--quick" in sys.argv)
    print("(ratios: variant / fused ppo; 'megalign' is the fused ppo op)")
    print(format_table(rows))
    print("\n".join(lines))
