"""Pure-torch reference of megalign.ops.policy_loss, written like verl's `compute_policy_loss`
(vanilla PPO/GRPO clipped surrogate with dual clip) plus GRPO's beta * k3 KL term, per token.

The math runs in float64 (`compute_dtype`) whatever the inputs' dtype (the loss is returned in
acc_dtype, the statistics in fp32), so the reference is the exact value rounded once; in
particular its k3 term does not cancel for small log-ratios as fp32 does (see
reference/kl_penalty.py). Tests pass compute_dtype=torch.float32 to measure plain fp32 torch.

Returns PolicyLossStats (megalign.ops.common), the statistics both paths return.
"""
from __future__ import annotations

import torch

from megalign.ops.common import LOG_RATIO_BOUND, PolicyLossStats, acc_dtype
from megalign.ops.reference.kl_penalty import k3


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
