"""Pure-torch reference of megalign.ops.kl_penalty: per-token KL estimators between a policy and a
reference model (Schulman, "Approximating KL Divergence", 2020; verl's `kl_penalty`).

With d = ref_logp - logp:
  k1          logp - ref_logp
  abs         |logp - ref_logp|
  k2          0.5 * (logp - ref_logp)^2
  k3          e^d - d - 1 (k3 below: never below 0, accurate for small |d|)
  low_var_kl  clamp(e^dc - dc - 1, -10, 10) with dc = clamp(d, -20, 20)  (verl)
Aliases (verl's names): "kl" -> "k1", "mse" -> "k2".

Results are fp32 (fp64 for fp64 inputs) but computed in float64 (`compute_dtype`) from the given
inputs, so they are the exact values rounded once. In fp32, expm1(d) - d loses every digit to
cancellation for |d| < ~1e-4 (where k3 ~ d^2 / 2) and ~1e-2 of them at |d| ~ 0.3; the kernels keep
~1e-6. Tests pass compute_dtype=torch.float32 to measure what plain fp32 torch gets.
"""
from __future__ import annotations

import torch

from megalign.ops.common import acc_dtype, resolve_kind


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", *,
               compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Elementwise KL estimate [*] -> [*] in acc_dtype(logp.dtype), computed in compute_dtype."""
    lp, ref = logp.to(compute_dtype), ref_logp.to(compute_dtype)
    return _estimate(lp, ref, resolve_kind(kind)).to(acc_dtype(logp.dtype))


# Below this |d|, k3 is summed from its Taylor series (truncation error < d^6 / 20160 < 1e-16 relative).
K3_SERIES_BELOW = 1e-2


def k3(d: torch.Tensor) -> torch.Tensor:
    """e^d - d - 1 elementwise, differentiable, to the precision of d's dtype (used in float64).

    expm1(d) - d cancels for small |d| (relative error ~ 2 eps / |d|, 2e-14 at |d| = 1e-2 in
    float64); below K3_SERIES_BELOW the series d^2/2 + d^3/6 + ... + d^7/5040 is used instead.
    The series sees d clamped to that range so it (and its gradient) stays finite where unused.
    """
    s = d.clamp(-K3_SERIES_BELOW, K3_SERIES_BELOW)
    series = s * s * (1 / 2 + s * (1 / 6 + s * (1 / 24 + s * (1 / 120 + s * (1 / 720 + s / 5040)))))
    return torch.where(d.abs() < K3_SERIES_BELOW, series, torch.expm1(d) - d)


def _estimate(lp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """The estimator `kind` (a canonical name, see KINDS) of lp and ref [*], in their dtype."""
    if kind == "k1":
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind == "k2":
        return 0.5 * (lp - ref).square()
    if kind == "k3":
        return k3(ref - lp)
    return torch.clamp(k3(torch.clamp(ref - lp, -20.0, 20.0)), -10.0, 10.0)


def kl_penalty_masked_mean(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                           kind: str = "k3", *, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """sum(kl over tokens where mask != 0) / count(mask != 0) as a 0-d tensor in acc_dtype(logp.dtype),
    computed (and summed) in compute_dtype; 0 when nothing is valid."""
    valid = mask != 0
    kl = _estimate(logp.to(compute_dtype), ref_logp.to(compute_dtype), resolve_kind(kind))
    return (torch.where(valid, kl, 0.0).sum() / valid.sum().clamp(min=1)).to(acc_dtype(logp.dtype))
