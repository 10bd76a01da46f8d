"""Pure-torch GAE with skipped positions: the reversed loop over t of TRL / DeepSpeed-Chat / verl,
with verl's multi-turn rule that masked tokens (tool outputs, padding) are removed from the
recursion. `megalign.ops.gae` documents the semantics; this is the readable definition.

The recursion runs in float64 (`compute_dtype`) whatever the inputs' dtype and is rounded once to
the output dtype (fp32, or fp64 for fp64 inputs): an fp32 recursion over T steps accumulates up to
~T roundings (with gamma = lam = 1, A_t is a suffix sum of T terms). Tests pass
compute_dtype=torch.float32 to measure what plain fp32 torch gets.
"""
from __future__ import annotations

import math

import torch

from megalign.ops._backend import FLOAT_DTYPES


def check_gae_args(rewards, values, mask, gamma, lam) -> torch.Tensor:
    """Validate the arguments of gae (errors name the argument); returns the mask as bool."""
    for name, t in (("rewards", rewards), ("values", values), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gae: {name} must be a tensor, got {type(t).__name__}")
    if rewards.dim() != 2:
        raise ValueError(f"gae: rewards must be [B, T], got shape {tuple(rewards.shape)}")
    if rewards.dtype not in FLOAT_DTYPES:
        raise TypeError(f"gae: rewards must be float32, float64, bfloat16 or float16, got {rewards.dtype}")
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
