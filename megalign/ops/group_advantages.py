"""Group-normalised advantages of group-sampled RL: GRPO (Shao et al. 2024, DeepSeekMath),
Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") and the RLOO leave-one-out
baseline (Ahmadian et al. 2024, "Back to Basics").

Groups are either contiguous runs of `group_size` (the usual layout of G samples per prompt) or
given by an id per score (verl's uid). The kernels: on the CPU, per-group sums in passes over the
scores (OpenMP across contiguous groups for large inputs); ids of any value are numbered inside
the kernel with a hash map, so no torch.unique (a sort, ~20x the arithmetic at N = 16384) runs
first. On CUDA, one warp per contiguous group, or ids mapped to dense ones with torch.unique, then
atomics into per-group sums and an elementwise pass.
"""
from __future__ import annotations

import torch

from megalign.ops import _backend
from megalign.ops.common import check_group_args, dense_group_ids
from megalign.ops.reference.group_advantages import group_advantages as reference_group_advantages


def group_advantages(scores: torch.Tensor, group_size: int | None = None, group_index: torch.Tensor | None = None,
                     mode: str = "grpo", eps: float = 1e-6, unbiased: bool = True) -> torch.Tensor:
    """Per-sample advantages from scalar scores normalised within each group.

    Args:
        scores: [N] float32 / float64 / bfloat16 / float16 rewards, one per sample.
        group_size: G, for contiguous groups scores[k*G:(k+1)*G] (N % G must be 0), or
        group_index: [N] integer ids, any values (e.g. verl's uid), uneven groups allowed.
            Pass exactly one of the two.
        mode: "grpo":    (r - mean) / (std + eps)     (the kernels multiply by the reciprocal)
              "dr_grpo": r - mean                    (no std scaling)
              "rloo":    r - mean of the other n-1 members = n / (n - 1) * (r - mean)
        eps: added to the std in grpo mode, >= 0.
        unbiased: std with n - 1 (torch.std's default, as in TRL/verl) or n (population).

    Returns:
        [N] float32 advantages (float64 for float64 scores).

    A group of one gives 0 in every mode, a group of equal scores gives exactly 0 (the mean is
    taken around a member, so it equals the scores bit for bit), and nothing is ever NaN, even
    with eps = 0. Statistics are two-pass (mean, then squared deviations) in float32 (float64 for
    float64). No gradients: advantages are constants of the policy loss; the scores are detached.
    """
    check_group_args(scores, group_size, group_index, mode, eps)
    scores = scores.detach()
    if not _backend.use_kernels(scores):
        return reference_group_advantages(scores, group_size, group_index, mode, eps, unbiased)
    if group_index is None:
        return torch.ops.megalign.group_advantages(scores, group_size, mode, float(eps), bool(unbiased))
    if scores.device.type == "cpu":
        return torch.ops.megalign.group_advantages_by_id(scores, group_index, mode, float(eps), bool(unbiased))
    ids, groups = dense_group_ids(group_index)
    return torch.ops.megalign.group_advantages_indexed(scores, ids, groups, mode, float(eps), bool(unbiased))


if _backend.HAVE_EXTENSION:

    def _out(scores):
        out = torch.float64 if scores.dtype == torch.float64 else torch.float32
        return scores.new_empty(scores.shape, dtype=out)

    @torch.library.register_fake("megalign::group_advantages")
    def _group_advantages_fake(scores, group_size, mode, eps, unbiased):
        return _out(scores)

    @torch.library.register_fake("megalign::group_advantages_by_id")
    def _group_advantages_by_id_fake(scores, group_index, mode, eps, unbiased):
        return _out(scores)

    @torch.library.register_fake("megalign::group_advantages_indexed")
    def _group_advantages_indexed_fake(scores, group_ids, num_groups, mode, eps, unbiased):
        return _out(scores)
