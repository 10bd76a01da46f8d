"""Pure-torch GAE with skipped positions: the reversed loop over t of TRL / DeepSpeed-Chat / verl,
with verl's multi-turn rule that masked tokens (tool outputs, padding) are removed from the
recursion. `megalign.ops.gae` documents the semantics; this is the readable definition.

The recursion runs in float64 (`compute_dtype`) whatever the inputs' dtype and is rounded once to
the output dtype (fp32, or fp64 for fp64 inputs): an fp32 recursion over T steps accumulates up to
~T roundings (with gamma = lam = 1, A_t is a suffix sum of T terms). Tests pass
compute_dtype=torch.float32 to measure what plain fp32 torch gets.
"""
from __future__ import annotations

import torch

from megalign.ops.common import check_gae_args


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0, *, compute_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `megalign.ops.gae` (same arguments and results), O(T) Python steps.

    rewards, values, mask [B, T] -> (advantages, returns) [B, T] in fp32 (fp64 for fp64 inputs),
    computed in compute_dtype.
    """
    valid = check_gae_args(rewards, values, mask, gamma, lam)
    out = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r, v = rewards.to(compute_dtype), values.to(compute_dtype)
    batch, steps = r.shape
    next_value = r.new_zeros(batch)
    next_adv = r.new_zeros(batch)
    columns = []
    gamma_lam = gamma * lam
    for t in reversed(range(steps)):
        # A zero coefficient drops its term (as the kernels do): 0 * inf would be NaN and carry a
        # non-finite score to positions that do not depend on it.
        adv_t = (r[:, t] + (gamma * next_value if gamma != 0 else 0.0) - v[:, t]
                 + (gamma_lam * next_adv if gamma_lam != 0 else 0.0))
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        next_value = torch.where(valid[:, t], v[:, t], next_value)
        columns.append(torch.where(valid[:, t], adv_t, 0.0))
    advantages = torch.stack(columns[::-1], dim=1) if columns else r.new_zeros(batch, 0)
    returns = torch.where(valid, advantages + v, 0.0)
    return advantages.to(out), returns.to(out)
