"""Pieces shared by the offline objectives (`preference`, `kto`, `prm`): input checks and metric sums.

- Inputs arrive in any float dtype; losses are computed in fp32 (fp64 inputs stay fp64, so
  `torch.autograd.gradcheck` can run on them). Gradients flow back in the input's dtype.
- Metrics are reported as `MetricSum(total, count)`: the trainer all-reduces both over the
  data-parallel group and logs total / count, so a mean over a subset (KTO's desirable examples,
  PRM's step positions) is the global mean whatever the split between ranks.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch


class MetricSum(NamedTuple):
    """A metric as a sum and a count (0-d tensors, detached); its value is total / count."""

    total: torch.Tensor
    count: torch.Tensor


def metric_sum(values: torch.Tensor, where: Optional[torch.Tensor] = None) -> MetricSum:
    """MetricSum of `values` [B] over all entries, or over those where the bool mask `where` [B] is True."""
    values = values.detach()
    if where is None:
        return MetricSum(values.sum(), torch.full((), values.numel(), dtype=values.dtype, device=values.device))
    where = where.to(values.dtype)
    return MetricSum((values * where).sum(), where.sum())


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else (bf16, fp16, fp32, integer counts)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def as_vectors(**tensors: torch.Tensor) -> list[torch.Tensor]:
    """Check that every tensor is [B] with the same B and return them in the compute dtype, in order.

    The keyword names are the caller's argument names, so an error says which argument is wrong.
    """
    names = list(tensors)
    first = tensors[names[0]]
    if not isinstance(first, torch.Tensor) or first.dim() != 1:
        raise ValueError(f"{names[0]} must be a 1-d tensor [batch], got "
                         f"{tuple(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__}")
    out = []
    for name in names:
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.shape != first.shape:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have the shape of {names[0]} {tuple(first.shape)}, got {shape}")
        out.append(t.to(compute_dtype(t)))
    return out


def check_positive(name: str, value: float) -> None:
    """Raise ValueError naming `name` unless value is a finite number > 0."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_non_negative(name: str, value: float) -> None:
    """Raise ValueError naming `name` unless value is a finite number >= 0."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
