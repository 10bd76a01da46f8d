"""Loss aggregation, shared by every online algorithm (`OnlineTrainer.train_role`: GRPO family, PPO, online DPO).

`LOSS_AGGREGATIONS` names how the per-token loss `[B, T]` of `megalign.ops.policy_loss` becomes one scalar:
  "token-mean"               DAPO (Yu et al. 2025): sum over every valid token / number of valid
                             tokens, so long responses weigh by their length;
  "seq-mean-token-mean"      the GRPO paper: mean over each response's tokens, then over responses,
                             which gives short responses more weight per token (the length bias
                             Dr. GRPO points out);
  "seq-mean-token-sum-norm"  Dr. GRPO (Liu et al. 2025): each response's token sum divided by a
                             constant (the max response length), then mean over responses, which
                             removes the length bias without DAPO's batch-dependent denominator.
Each mode is a per-token weight times the loss, summed, over a denominator (`loss_normalizer`)
that counts tokens or responses of the *whole* mini-batch on *every* data-parallel rank. The
count is a tensor all-reduced over the dp group (no `.item()`), so with gradients summed over dp
(`allreduce_gradients(average=False)`) every rank's share adds up to the global mean, whatever
the split of tokens between ranks or micro-batches. Responses without a valid token (e.g. masked
as overlong) count in no denominator.
verl's "seq-mean-token-sum-norm" divides the batch's token sum by the constant alone; ours also
divides by the number of responses (as the "seq-mean" in the name says), so the scale does not
grow with the batch size.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist


class LossAggregation(NamedTuple):
    """One aggregation mode: per-token weights and what the denominator counts."""

    weights: Callable[[torch.Tensor, Optional[int]], torch.Tensor]
    """(mask [B, T] float, max_response_length) -> per-token weights [B, T] (0 at masked tokens)."""
    counts_tokens: bool
    """True: the denominator counts valid tokens; False: responses with at least one valid token."""


def _token_mean_weights(mask: torch.Tensor, max_response_length: Optional[int]) -> torch.Tensor:
    return mask


def _seq_mean_token_mean_weights(mask: torch.Tensor, max_response_length: Optional[int]) -> torch.Tensor:
    return mask / mask.sum(-1, keepdim=True).clamp(min=1)


def _seq_mean_token_sum_norm_weights(mask: torch.Tensor, max_response_length: Optional[int]) -> torch.Tensor:
    if max_response_length is None or max_response_length < 1:
        raise ValueError(f"seq-mean-token-sum-norm needs max_response_length >= 1 (Dr. GRPO's constant), "
                         f"got {max_response_length}")
    return mask / max_response_length


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "token-mean": LossAggregation(_token_mean_weights, counts_tokens=True),
    "seq-mean-token-mean": LossAggregation(_seq_mean_token_mean_weights, counts_tokens=False),
    "seq-mean-token-sum-norm": LossAggregation(_seq_mean_token_sum_norm_weights, counts_tokens=False),
}


def _aggregation(mode: str) -> LossAggregation:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; one of {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[mode]


def loss_normalizer(mask: torch.Tensor, mode: str, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The denominator of `aggregate_loss` for a whole mini-batch: a 0-d fp32 tensor, no host sync.

    Args:
        mask: [B, T] response-token mask of this rank's part of the mini-batch (all its micro-batches).
        mode: a key of LOSS_AGGREGATIONS.
        group: the data-parallel group to sum the count over (None or size 1: this rank only).

    Returns: the number of valid tokens ("token-mean") or of responses with a valid token (the
    seq-mean modes) over the group, clamped to >= 1 so an all-masked mini-batch gives loss 0.
    """
    valid = mask.float()
    count = valid.sum() if _aggregation(mode).counts_tokens else (valid.sum(-1) > 0).float().sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count.clamp(min=1.0)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: torch.Tensor,
                   max_response_length: Optional[int] = None) -> torch.Tensor:
    """This rank's share of the mini-batch loss: sum(weights * loss) / normalizer, a 0-d tensor.

    Args:
        loss: [B, T] per-token loss (e.g. `megalign.ops.policy_loss`, 0 at masked tokens).
        mask: [B, T] response-token mask (nonzero = valid).
        mode: a key of LOSS_AGGREGATIONS (see the module docstring).
        normalizer: `loss_normalizer(mini-batch mask, mode, dp group)`; the same on every rank.
        max_response_length: Dr. GRPO's constant (the generation limit), for "seq-mean-token-sum-norm".

    Summed over micro-batches and dp ranks this is the mode's mean over the whole mini-batch.
    """
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"loss and mask must both be [batch, tokens], got {tuple(loss.shape)} and {tuple(mask.shape)}")
    weights = _aggregation(mode).weights(mask.to(loss.dtype), max_response_length)
    return (loss * weights).sum() / normalizer
