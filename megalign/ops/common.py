"""Definitions shared by the ops' Python face (`megalign.ops.*`), their pure-torch references
(`megalign.ops.reference`, the tests' oracle) and the algorithms built on them, so that none of
those imports a type, a name list or a constant from the reference path: the accumulation dtype
rule, the KL estimators' names, the policy loss's log-ratio bound and its statistics, and the
argument checks of group_advantages and gae (with the dense group ids both paths number groups by).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from megalign.ops._backend import FLOAT_DTYPES

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


MODES = ("grpo", "dr_grpo", "rloo")


def _check_float_tensor(op: str, name: str, t, layout: str) -> None:
    """`t` is a float32/float64/bfloat16/float16 tensor with as many dims as `layout` ("[B, T]") names."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != layout.count(",") + 1:
        raise ValueError(f"{op}: {name} must be {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, float64, bfloat16 or float16, got {t.dtype}")


def check_group_args(scores, group_size, group_index, mode, eps) -> None:
    """Validate the arguments of group_advantages (errors name the argument)."""
    _check_float_tensor("group_advantages", "scores", scores, "[N]")
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


def check_gae_args(rewards, values, mask, gamma, lam) -> torch.Tensor:
    """Validate the arguments of gae (errors name the argument); returns the mask as bool."""
    _check_float_tensor("gae", "rewards", rewards, "[B, T]")
    for name, t in (("values", values), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gae: {name} must be a tensor, got {type(t).__name__}")
    if values.shape != rewards.shape:
        raise ValueError(f"gae: values must have the shape of rewards {tuple(rewards.shape)}, got {tuple(values.shape)}")
    if values.dtype != rewards.dtype:
        raise TypeError(f"gae: values must have the dtype of rewards ({rewards.dtype}), got {values.dtype}")
    if mask.shape != rewards.shape:
        raise ValueError(f"gae: mask must have the shape of rewards {tuple(rewards.shape)}, got {tuple(mask.shape)}")
    if mask.dtype.is_complex:
        raise TypeError(f"gae: mask must be bool or real (nonzero = valid), got {mask.dtype}")
    for name, t in (("values", values), ("mask", mask)):
        if t.device != rewards.device:
            raise ValueError(f"gae: {name} is on {t.device} but rewards is on {rewards.device}")
    for name, x in (("gamma", gamma), ("lam", lam)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"gae: {name} must be a finite number, got {x!r}")
    return mask if mask.dtype == torch.bool else mask != 0
