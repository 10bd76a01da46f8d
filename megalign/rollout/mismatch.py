"""How far the trainer's log-probs are from the rollout engine's: the statistic every online step logs.

The engine records log softmax(logits / T) of each sampled token while decoding; the trainer recomputes the same
quantity (same weights, same T) with one forward over the finished sequences. In exact arithmetic the two are equal;
in floating point they differ by rounding unless the batch-invariant mode (`megalign.models.batch_invariant`) is on.
With `rollout.old_logprobs: rollout` a difference makes the first epoch's importance ratios differ from 1.

`mismatch_sums` reduces one rank's tokens to four numbers (max |d|, sum of k3, tokens equal bit for bit, tokens),
so any number of micro-batches and ranks combine exactly; `mismatch_metrics` turns the sums, reduced over the
ranks (max for the first, sum for the rest), into the logged metrics:

    rollout/logprob_max_abs_diff   max |d| over the response tokens, d = recomputed - rollout
    rollout/logprob_k3             mean of k3 = exp(d) - 1 - d (Schulman's unbiased estimator of KL(rollout || trainer)
                                   for tokens sampled by the rollout; >= 0, 0 iff d = 0)
    rollout/logprob_bitwise_equal  fraction of tokens whose two fp32 log-probs are equal bit for bit
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

METRICS = ("rollout/logprob_max_abs_diff", "rollout/logprob_k3", "rollout/logprob_bitwise_equal")


def mismatch_sums(recomputed: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp64 `[4]`: (max |d|, sum k3, tokens with d == 0 bit for bit, tokens) over the tokens where `mask` is set.

    recomputed, rollout: `[N, R]` log-probs (fp32); mask: `[N, R]` (bool or 0/1) the response tokens. The k3 of a
    token is computed in fp64 from the fp32 difference (exp(d) - 1 - d loses everything in fp32 for |d| < 1e-4).
    """
    if recomputed.shape != rollout.shape or mask.shape != rollout.shape:
        raise ValueError(f"recomputed {tuple(recomputed.shape)}, rollout {tuple(rollout.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same shape")
    keep = mask.bool()
    d = (recomputed.float() - rollout.float())[keep].double()
    k3 = torch.expm1(d) - d
    equal = (recomputed.float()[keep].view(torch.int32) == rollout.float()[keep].view(torch.int32)).sum()
    top = d.abs().max() if d.numel() else d.new_zeros(())
    return torch.stack([top, k3.sum(), equal.double(), d.new_tensor(float(d.numel()))])


def reduce_sums(sums: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """`mismatch_sums` of every rank of `group` combined (max of the first entry, sum of the others); as is without
    an initialised process group or on one rank."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return sums
    top, rest = sums[:1].clone(), sums[1:].clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(rest, group=group)
    return torch.cat([top, rest])


def mismatch_metrics(sums: torch.Tensor) -> dict[str, float]:
    """The three metrics (module doc) from combined sums; empty when no token was measured."""
    top, k3, equal, count = sums.tolist()
    if count == 0:
        return {}
    return dict(zip(METRICS, (top, k3 / count, equal / count)))


class MismatchMeter:
    """One training step's mismatch, for a trainer: `start` at the step's beginning, `add` where the trainer recomputes
    the old log-probs, `observe` in the policy loss (it measures only the first micro-batch after `start(True)`: with
    `old_logprobs: rollout` nothing is recomputed, and the first micro-batch of the first epoch runs the policy before
    any update, so its log-probs are the recomputation at no extra forward), `metrics` at the end (every rank calls it:
    a collective over all ranks; tp and pp copies count once in the means since every copy holds the same numbers)."""

    def __init__(self):
        self.sums: Optional[torch.Tensor] = None
        self.pending = False
        self.skip = 0

    def start(self, measure_in_loss: bool, skip: int = 0) -> None:
        """`skip`: loss calls to pass over before the first micro-batch's: 1 at pp > 1, where the pipeline's shape
        inference runs micro-batch 0's loss once on uninitialised activations before the real run
        (`megalign.parallel.pipeline`, "Schedules")."""
        self.sums, self.pending, self.skip = None, measure_in_loss, skip

    def add(self, recomputed: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        sums = mismatch_sums(recomputed.detach(), rollout, mask)
        if self.sums is not None:
            sums = torch.cat([torch.maximum(self.sums[:1], sums[:1]), self.sums[1:] + sums[1:]])
        self.sums = sums

    def observe(self, recomputed: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        if self.pending and self.skip:
            self.skip -= 1
        elif self.pending:
            self.pending = False
            self.add(recomputed, rollout, mask)

    def metrics(self, device: torch.device) -> dict[str, float]:
        sums = self.sums if self.sums is not None else torch.zeros(4, dtype=torch.float64)
        return mismatch_metrics(reduce_sums(sums.to(device)))
