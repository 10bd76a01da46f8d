"""Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
Using Generalized Advantage Estimation", eq. 16) over token sequences with skipped positions.

The kernels: on the CPU, OpenMP across rows and one reverse walk per row; on CUDA, one block per
row that scans tiles of the row with a block-wide scan of affine maps (csrc/include/megalign/
math/advantage.h), so T up to 32k does not run as one thread walking T.
"""
from __future__ import annotations

import torch

from megalign.ops import _backend
from megalign.ops.common import check_gae_args
from megalign.ops.reference.gae import gae as reference_gae


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of PPO's critic targets, skipping masked positions.

    Args:
        rewards: [B, T] per-token rewards, float32 / float64 / bfloat16 / float16.
        values: [B, T] critic values, same dtype as rewards.
        mask: [B, T] bool, or a 0/1 float/int tensor; nonzero = valid (a response token).
        gamma: discount. lam: GAE lambda.

    Returns:
        (advantages, returns), both [B, T] float32 (float64 for float64 inputs).

    Semantics (verl's multi-turn GAE, where tool-output tokens inside a response are skipped):
    masked positions are removed from the recursion. For each valid t let n(t) be the next valid
    position after t; past the last valid position the bootstrap value and advantage are 0. Then

        delta_t   = r_t + gamma * V_{n(t)} - V_t
        A_t       = delta_t + gamma * lam * A_{n(t)}
        returns_t = A_t + V_t

    Leading padding, trailing padding and holes inside a sequence all follow this one rule, and an
    all-masked row gives zeros. Masked positions get advantage 0 and return 0, and their rewards and
    values are ignored: a reward placed on a masked token is dropped (use `masked_reward_count` to
    log how many were). Accumulation is float32 (float64 for float64 inputs). A gamma or
    gamma * lam of exactly 0 drops its term rather than multiplying by 0, so an inf or NaN score
    makes non-finite only the advantages that depend on it (with lam = 0: A_k and, through V_k,
    A_{n^-1(k)}), the same on the CPU walk and the CUDA scan.

    No gradients: GAE targets are constants of the PPO loss, so the inputs are detached and the
    outputs never require grad.
    """
    valid = check_gae_args(rewards, values, mask, gamma, lam)
    rewards, values = rewards.detach(), values.detach()
    if not _backend.use_kernels(rewards):
        return reference_gae(rewards, values, valid, gamma, lam)
    return torch.ops.megalign.gae(rewards, values, valid, float(gamma), float(lam))


def masked_reward_count(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Number of nonzero rewards at masked positions (which `gae` drops), as a 0-dim int64 tensor
    (no host sync), for the trainer to log."""
    valid = mask if mask.dtype == torch.bool else mask != 0
    return ((rewards != 0) & ~valid).sum()


if _backend.HAVE_EXTENSION:

    @torch.library.register_fake("megalign::gae")
    def _gae_fake(rewards, values, mask, gamma, lam):
        out = torch.float64 if rewards.dtype == torch.float64 else torch.float32
        return rewards.new_empty(rewards.shape, dtype=out), rewards.new_empty(rewards.shape, dtype=out)
