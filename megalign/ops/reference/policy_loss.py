"""Pure-torch reference of megalign.ops.policy_loss, written like verl's `compute_policy_loss`
(vanilla PPO/GRPO clipped surrogate with dual clip) plus GRPO's beta * k3 KL term, per token.

The math runs in float64 (`compute_dtype`) whatever the inputs' dtype (the loss is returned in
acc_dtype, the statistics in fp32), so the reference is the exact value rounded once; in
particular its k3 term does not cancel for small log-ratios as fp32 does (see
reference/kl_penalty.py). Tests pass compute_dtype=torch.float32 to measure plain fp32 torch.

Also defines PolicyLossStats, the statistics both paths return.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megalign.ops.reference.kl_penalty import acc_dtype, k3

LOG_RATIO_BOUND = 20.0


class PolicyLossStats(NamedTuple):
    """Statistics of one policy_loss call over its valid tokens (mask != 0), each a 0-d fp32
    tensor (no host sync). With no valid token every field is finite: count 0, fractions and
    means 0, ratio_min = ratio_max = 1.

    Fields, in the order of the kernel's stats vector (megalign/math/policy.h, PolicyStat):
      count:           number of valid tokens.
      clip_frac:       fraction of valid tokens where the clipped surrogate is the larger one
                       (verl's pg_clipfrac: surr2 > surr1).
      dual_clip_frac:  fraction of valid tokens with A < 0 where the dual-clip bound -A*c is used
                       (verl's pg_clipfrac_lower); 0 without dual_clip.
      approx_kl:       mean of old_logp - logp using the clamped log-ratio (verl's ppo_kl).
      ratio_min:       smallest importance ratio exp(clamp(logp - old_logp, -20, 20)).
      ratio_max:       largest importance ratio.
      kl_mean:         mean k3(logp, ref_logp); 0 when ref_logp is not given.
    """

    count: torch.Tensor
    clip_frac: torch.Tensor
    dual_clip_frac: torch.Tensor
    approx_kl: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    kl_mean: torch.Tensor

    @classmethod
    def from_tensor(cls, stats: torch.Tensor) -> "PolicyLossStats":
        """Split the kernel's fp32 stats vector [7] into named 0-d views."""
        return cls(*stats.unbind(0))


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None,
                beta: float = 0.0, ref_logp: torch.Tensor | None = None, *,
                compute_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, PolicyLossStats]:
    """Per-token loss [*] in acc_dtype(logp.dtype) (0 where mask == 0) and its statistics,
    computed in compute_dtype.

    Only `logp` carries gradient: old_logp, advantages and ref_logp are detached (constants of
    the RL step), as in the kernel.
    """
    eps_high = eps_low if eps_high is None else eps_high
    acc = compute_dtype
    lp = logp.to(acc)
    old, adv = old_logp.detach().to(acc), advantages.detach().to(acc)
    valid = mask != 0

    log_ratio = torch.clamp(lp - old, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    surr1 = -adv * ratio
    surr2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(surr1, surr2)
    clipped = surr2 > surr1
    if dual_clip is not None:
        surr3 = -adv * dual_clip
        dual = (adv < 0) & (loss > surr3)
        loss = torch.where(adv < 0, torch.minimum(loss, surr3), loss)
    else:
        dual = torch.zeros_like(clipped)
    kl = k3(ref_logp.detach().to(acc) - lp) if ref_logp is not None else torch.zeros_like(lp)
    if beta > 0:
        loss = loss + beta * kl
    loss = torch.where(valid, loss, 0.0)

    count = valid.sum()
    n = count.clamp(min=1).to(acc)

    def masked_mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.to(acc), 0.0).sum() / n

    sentinel = ratio.new_full((1,), float("inf"))
    ratio_min = torch.cat([torch.where(valid, ratio, float("inf")).flatten(), sentinel]).amin()
    ratio_max = torch.cat([torch.where(valid, ratio, -float("inf")).flatten(), -sentinel]).amax()
    any_valid = count > 0
    stats = torch.stack([
        count.to(acc),
        masked_mean(clipped),
        masked_mean(dual),
        masked_mean(-log_ratio),
        torch.where(any_valid, ratio_min, 1.0),
        torch.where(any_valid, ratio_max, 1.0),
        masked_mean(kl),
    ]).detach().float()
    return loss.to(acc_dtype(logp.dtype)), PolicyLossStats.from_tensor(stats)
