"""Pure-torch group-normalised advantages (GRPO, Dr. GRPO, RLOO), vectorised with index_add /
scatter_reduce over dense group ids (torch.unique maps arbitrary ids to them).
`megalign.ops.group_advantages` documents the semantics.

The statistics are computed in float64 whatever the scores' dtype and the advantages rounded once
to fp32 (fp64 for fp64 scores): in fp32, rounding the group mean costs up to ~17 eps * max|A| for
scores with a large common offset (e.g. 1000 + N(0, 1)) or groups of 16k, as much as the kernels.
"""
from __future__ import annotations

import math

import torch

from megalign.ops._backend import FLOAT_DTYPES

MODES = ("grpo", "dr_grpo", "rloo")


def check_group_args(scores, group_size, group_index, mode, eps) -> None:
    """Validate the arguments of group_advantages (errors name the argument)."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"group_advantages: scores must be a tensor, got {type(scores).__name__}")
    if scores.dim() != 1:
        raise ValueError(f"group_advantages: scores must be [N], got shape {tuple(scores.shape)}")
    if scores.dtype not in FLOAT_DTYPES:
        raise TypeError(f"group_advantages: scores must be float32, float64, bfloat16 or float16, got {scores.dtype}")
    if mode not in MODES:
        raise ValueError(f"group_advantages: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"group_advantages: eps must be a finite number >= 0, got {eps!r}")
    if (group_size is None) == (group_index is None):
        raise ValueError("group_advantages: pass exactly one of group_size (contiguous groups) and "
                         "group_index (an id per score)")
    n = scores.shape[0]
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_advantages: group_size must be an int >= 1, got {group_size!r}")
        if n % group_size:
            raise ValueError(f"group_advantages: group_size {group_size} does not divide the number of scores {n}")
        return
    if not isinstance(group_index, torch.Tensor):
        raise TypeError(f"group_advantages: group_index must be a tensor, got {type(group_index).__name__}")
    if group_index.dtype.is_floating_point or group_index.dtype.is_complex or group_index.dtype == torch.bool:
        raise TypeError(f"group_advantages: group_index must be an integer tensor, got {group_index.dtype}")
    if group_index.shape != scores.shape:
        raise ValueError(f"group_advantages: group_index must have the shape of scores {tuple(scores.shape)}, "
                         f"got {tuple(group_index.shape)}")
    if group_index.device != scores.device:
        raise ValueError(f"group_advantages: group_index is on {group_index.device} but scores is on {scores.device}")


def dense_group_ids(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[N] integer ids -> ([N] int64 ids in [0, groups), groups), numbered in sorted id order."""
    uniq, dense = torch.unique(group_index, return_inverse=True)
    return dense.to(torch.int64), uniq.numel()


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
