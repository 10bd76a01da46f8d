"""KTO (Ethayarajh et al. 2024, arXiv 2402.01306): unpaired binary feedback, as pure tensor functions.

Each example is one (x, y) labelled desirable or undesirable. With r = log pi(y|x) - log pi_ref(y|x)
(summed log-probs) and the reference point z0, the per-example loss is

    desirable     w_D (1 - sigma(beta (r - z0)))
    undesirable   w_U (1 - sigma(beta (z0 - r)))

z0 estimates KL(pi || pi_ref) from mismatched pairs: completion y_j scored under another example's
prompt x_i (TRL and OpenRLHF shift the completions of the batch by one). The caller gives those
pairs' log-ratios log pi(y_j|x_i) - log pi_ref(y_j|x_i); z0 is their mean, detached (the paper
treats it as a constant), taken over the data-parallel group when one is passed, and clamped at 0.
The mean is over every mismatched pair of the group (sum / count all-reduced), where TRL and
OpenRLHF average the per-rank means; the two agree when every rank holds as many pairs.

Losses are per example [B], unreduced, like `megalign.algos.preference`: the trainer sums them and
divides by the global number of examples (TRL's mean over the concatenated desirable and
undesirable losses).

The paper's rule for the weights: w_D n_D / (w_U n_U) in [1, 4/3], with n_D, n_U the counts of
desirable and undesirable examples (`kto_weight_ratio`, `check_kto_weight_ratio`).
"""
from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megalign.algos.common import MetricSum, as_vectors, check_positive, compute_dtype, metric_sum

KTO_WEIGHT_RATIO_RANGE = (1.0, 4.0 / 3.0)
"""The paper's recommended range of w_D n_D / (w_U n_U)."""


class KTOStats(NamedTuple):
    """Per-example statistics (detached [B] tensors) and the reference point used."""

    rewards: torch.Tensor
    """beta (log pi(y) - log pi_ref(y))."""
    logps: torch.Tensor
    """Summed policy log-probs."""
    desirable: torch.Tensor
    """[B] bool labels."""
    kl: torch.Tensor
    """0-d: z0, the same on every rank of the group."""

    def metrics(self) -> dict[str, MetricSum]:
        """TRL's KTOTrainer metric names; chosen = desirable, rejected = undesirable examples."""
        undesirable = ~self.desirable
        return {
            "rewards/chosen": metric_sum(self.rewards, self.desirable),
            "rewards/rejected": metric_sum(self.rewards, undesirable),
            "logps/chosen": metric_sum(self.logps, self.desirable),
            "logps/rejected": metric_sum(self.logps, undesirable),
            "kl": MetricSum(self.kl, torch.ones_like(self.kl)),
        }


def kto_reference_point(kl_logratios: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """z0 [0-d, detached]: max(0, mean of the mismatched pairs' log-ratios over the group).

    Args:
        kl_logratios: [M] log pi(y_j|x_i) - log pi_ref(y_j|x_i) of this rank's mismatched pairs (M may be 0).
        group: the data-parallel group to average over (None or size 1: this rank only).

    One all-reduce of (sum, count), no host sync; 0 when the group holds no pair.
    """
    if kl_logratios.dim() != 1:
        raise ValueError(f"kl_logratios must be a 1-d tensor [pairs], got {tuple(kl_logratios.shape)}")
    kl = kl_logratios.detach().to(compute_dtype(kl_logratios))
    sums = torch.stack([kl.sum(), torch.full((), kl.numel(), dtype=kl.dtype, device=kl.device)])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return (sums[0] / sums[1].clamp(min=1)).clamp(min=0)


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
             kl_logratios: torch.Tensor, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0,
             group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, KTOStats]:
    """KTO loss per example [B] (module docstring).

    Args:
        policy_logps, ref_logps: [B] summed log pi(y|x), log pi_ref(y|x) of the labelled completions.
        desirable: [B] bool, True for desirable (thumbs-up) examples.
        kl_logratios: [M] log-ratios of the mismatched pairs (`kto_reference_point`).
        beta: > 0; desirable_weight, undesirable_weight: w_D, w_U > 0.
        group: the data-parallel group z0 is averaged over.

    Returns: (losses [B], stats with the implicit rewards and z0).
    """
    return kto_loss_at(policy_logps, ref_logps, desirable, kto_reference_point(kl_logratios, group), beta=beta,
                       desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)


def kto_loss_at(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor, *,
                beta: float = 0.1, desirable_weight: float = 1.0,
                undesirable_weight: float = 1.0) -> tuple[torch.Tensor, KTOStats]:
    """`kto_loss` at a reference point z0 (0-d, detached) computed beforehand: a pipelined trainer takes z0 over
    the whole batch (`kto_reference_point`) before its micro-batches' losses, each of which sees a part of it."""
    check_positive("beta", beta)
    check_positive("desirable_weight", desirable_weight)
    check_positive("undesirable_weight", undesirable_weight)
    if not isinstance(desirable, torch.Tensor) or desirable.dtype != torch.bool:
        raise ValueError(f"desirable must be a bool tensor [batch], got "
                         f"{desirable.dtype if isinstance(desirable, torch.Tensor) else type(desirable).__name__}")
    if z0.dim() != 0:
        raise ValueError(f"z0 must be a 0-d tensor, got shape {tuple(z0.shape)}")
    logp, ref, _ = as_vectors(policy_logps=policy_logps, ref_logps=ref_logps, desirable=desirable)
    z0 = z0.detach().to(logp.dtype)
    r = logp - ref
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))
    return losses, KTOStats((beta * r).detach(), logp.detach(), desirable, z0)


def kto_weight_ratio(num_desirable: int, num_undesirable: int, desirable_weight: float = 1.0,
                     undesirable_weight: float = 1.0) -> float:
    """w_D n_D / (w_U n_U): inf when there are no undesirable examples."""
    check_positive("desirable_weight", desirable_weight)
    check_positive("undesirable_weight", undesirable_weight)
    if num_desirable < 0 or num_undesirable < 0 or num_desirable + num_undesirable == 0:
        raise ValueError(f"num_desirable={num_desirable} and num_undesirable={num_undesirable} must be >= 0, "
                         f"not both 0")
    if num_undesirable == 0:
        return float("inf")
    return desirable_weight * num_desirable / (undesirable_weight * num_undesirable)


def check_kto_weight_ratio(num_desirable: int, num_undesirable: int, desirable_weight: float = 1.0,
                           undesirable_weight: float = 1.0) -> float:
    """`kto_weight_ratio`, with a UserWarning when it lies outside KTO_WEIGHT_RATIO_RANGE; returns the ratio."""
    ratio = kto_weight_ratio(num_desirable, num_undesirable, desirable_weight, undesirable_weight)
    low, high = KTO_WEIGHT_RATIO_RANGE
    if not low <= ratio <= high:
        warnings.warn(f"KTO: desirable_weight * num_desirable / (undesirable_weight * num_undesirable) = "
                      f"{desirable_weight} * {num_desirable} / ({undesirable_weight} * {num_undesirable}) = "
                      f"{ratio:.4g} is outside [{low}, {high:.4g}] (Ethayarajh et al. 2024); "
                      f"adjust the weights so the ratio falls inside", UserWarning, stacklevel=2)
    return ratio
