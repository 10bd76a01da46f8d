"""Pure-torch reference of megalign.ops.kl_penalty: per-token KL estimators between a policy and a
reference model (Schulman, "Approximating KL Divergence", 2020; verl's `kl_penalty`).

With d = ref_logp - logp:
  k1          logp - ref_logp
  abs         |logp - ref_logp|
  k2          0.5 * (logp - ref_logp)^2
  k3          e^d - d - 1, computed as expm1(d) - d (equal, but never rounds below 0)
  low_var_kl  clamp(e^dc - dc - 1, -10, 10) with dc = clamp(d, -20, 20)  (verl)
Aliases (verl's names): "kl" -> "k1", "mse" -> "k2". Values are computed in fp32 (fp64 for fp64).
"""
from __future__ import annotations

import torch

KINDS = ("k1", "abs", "k2", "k3", "low_var_kl")
ALIASES = {"kl": "k1", "mse": "k2"}


def resolve_kind(kind: str) -> str:
    """The canonical estimator name for `kind` (aliases resolved); ValueError naming `kind` otherwise."""
    canonical = ALIASES.get(kind, kind)
    if canonical not in KINDS:
        valid = ", ".join(KINDS + tuple(ALIASES))
        raise ValueError(f"kl_penalty: kind must be one of {valid}, got {kind!r}")
    return canonical


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation/output dtype of the KL and policy-loss ops: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Elementwise KL estimate, same shape as `logp`, in acc_dtype(logp.dtype)."""
    kind = resolve_kind(kind)
    acc = acc_dtype(logp.dtype)
    lp, ref = logp.to(acc), ref_logp.to(acc)
    if kind == "k1":
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind == "k2":
        return 0.5 * (lp - ref).square()
    if kind == "k3":
        d = ref - lp
        return torch.expm1(d) - d
    d = torch.clamp(ref - lp, -20.0, 20.0)
    return torch.clamp(torch.expm1(d) - d, -10.0, 10.0)


def kl_penalty_masked_mean(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                           kind: str = "k3") -> torch.Tensor:
    """sum(kl over tokens where mask != 0) / count(mask != 0) as a 0-d tensor; 0 when nothing is valid."""
    valid = mask != 0
    kl = kl_penalty(logp, ref_logp, kind)
    return torch.where(valid, kl, 0.0).sum() / valid.sum().clamp(min=1)
