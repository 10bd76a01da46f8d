"""Definitions shared by the ops' Python face (`megalign.ops.*`), their pure-torch references
(`megalign.ops.reference`, the tests' oracle) and the algorithms built on them, so that none of
those imports a type, a name list or a constant from the reference path: the accumulation dtype
rule, the KL estimators' names, the policy loss's log-ratio bound and its statistics.
"""
from __future__ import annotations

from typing import NamedTuple

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
