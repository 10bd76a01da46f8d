"""Pure-torch group-normalised advantages (GRPO, Dr. GRPO, RLOO), vectorised with index_add /
scatter_reduce over dense group ids (torch.unique maps arbitrary ids to them).
`megalign.ops.group_advantages` documents the semantics.

The statistics are computed in float64 whatever the scores' dtype and the advantages rounded once
to fp32 (fp64 for fp64 scores): in fp32, rounding the group mean costs up to ~17 eps * max|A| for
scores with a large common offset (e.g. 1000 + N(0, 1)) or groups of 16k, as much as the kernels.
"""
from __future__ import annotations

import torch

from megalign.ops.common import check_group_args, dense_group_ids


def group_advantages(scores: torch.Tensor, group_size: int | None = None, group_index: torch.Tensor | None = None,
                     mode: str = "grpo", eps: float = 1e-6, unbiased: bool = True) -> torch.Tensor:
    """Reference of `megalign.ops.group_advantages` (same arguments and result)."""
    check_group_args(scores, group_size, group_index, mode, eps)
    if group_index is None:
        n = scores.shape[0]
        ids, groups = torch.arange(n, device=scores.device) // group_size, n // group_size
    else:
        ids, groups = dense_group_ids(group_index)
    return grouped_advantages(scores, ids, groups, mode, eps, unbiased)


def grouped_advantages(scores: torch.Tensor, ids: torch.Tensor, groups: int, mode: str, eps: float,
                       unbiased: bool) -> torch.Tensor:
    """The math of group_advantages on checked arguments: dense int64 ids [N] in [0, groups).

    scores [N] -> advantages [N] in fp32 (fp64 for fp64 scores), computed in float64.
    """
    n = scores.shape[0]
    out = torch.float64 if scores.dtype == torch.float64 else torch.float32
    x = scores.to(torch.float64)
    count = torch.bincount(ids, minlength=groups)
    first = torch.full((groups,), n, dtype=torch.int64, device=x.device)
    first = first.scatter_reduce(0, ids, torch.arange(n, device=x.device), reduce="amin")
    pivot = x[first.clamp(max=max(n - 1, 0))]  # every group has a member, so first < n
    shifted = x.new_zeros(groups).index_add(0, ids, x - pivot[ids])
    mean = pivot + shifted / count.clamp(min=1)
    d = x - mean[ids]
    sq = x.new_zeros(groups).index_add(0, ids, d * d)
    dof = count - 1 if unbiased else count
    std = torch.sqrt(sq / dof.clamp(min=1))
    size = count[ids]
    if mode == "grpo":
        den = std[ids] + eps
        adv = torch.where((d != 0) & (den > 0), d / den, 0.0)
    elif mode == "dr_grpo":
        adv = d
    else:
        adv = d * size / (size - 1).clamp(min=1)
    return torch.where(size > 1, adv, 0.0).to(out)
