"""Summed response log-probs of whole sequences: what the DPO family, KTO and online DPO compare.

A pair batch (`PairBatch`, `collate_preferences`' layout) holds B prompts twice, [2B, T]: rows 0..B-1
end in the chosen responses, rows B..2B-1 in the rejected ones; `targets` marks the response tokens
(IGNORE_INDEX elsewhere). `sequence_logps` runs the trunk on it and `hidden_sequence_logps` the fused LM
head on the response positions only (`target_logps`), so neither [R, T, V] nor [N, V] logits exist. A
pipeline micro-batch holds consecutive rows, so a pipelined loss takes the rows in `interleaved_pairs`
order (chosen 0, rejected 0, chosen 1, ...): every micro-batch of an even number of rows then holds
whole pairs.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megalign.algos.preference import wpo_token_logps
from megalign.data import IGNORE_INDEX
from megalign.models import CausalLM
from megalign.parallel import ParallelLayout


@dataclasses.dataclass
class PairBatch:
    """B pairs as one [2B, T] batch (`collate_preferences`): rows 0..B-1 prompt + chosen, rows B..2B-1
    prompt + rejected; `response_lengths` [2B] target tokens with loss; `margin` [B];
    `ref_scores` [B, 2] (chosen, rejected) summed reference log-probs, filled by the trainer."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    response_lengths: torch.Tensor
    margin: torch.Tensor
    ref_scores: Optional[torch.Tensor] = None


def interleaved_pairs(n: int, device: torch.device) -> torch.Tensor:
    """[2n] row order chosen 0, rejected 0, chosen 1, ... of a [2n]-row pair batch (chosen rows, then rejected)."""
    return torch.stack([torch.arange(n), torch.arange(n) + n], 1).flatten().to(device)


def target_logps(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor,
                 layout: ParallelLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [N], log p [N] fp32) of the N target tokens of `targets` [R, T] (IGNORE_INDEX: none), in row-major
    order, from the trunk's output `hidden` [R, T, H] (on a pipeline, the last stage's).

    Only the positions with a target go through the LM head: their hidden states are gathered into
    [N, H] and `LMHead.token_logprob` (`fused_linear_token_logprob`) projects them chunk by chunk onto
    this rank's vocabulary shard; log p(y_t) = log softmax(h_t W^T)[y_t]. Under autocast the head runs
    in the autocast dtype, as `F.linear` would.
    """
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    return rows, model.lm_head.token_logprob(hidden[rows, cols], targets[rows, cols],
                                             layout.tp_group if layout.tp > 1 else None)


def hidden_sequence_logps(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor,
                          layout: ParallelLayout) -> torch.Tensor:
    """[R] summed log-probs of each row's target tokens (`target_logps`): log p(y) = sum over the row's response
    tokens of log p(y_t), DPO's summed log-probs (Rafailov et al. 2023, eq. 7)."""
    rows, logp = target_logps(model, hidden, targets, layout)
    return logp.new_zeros(targets.shape[0]).index_add(0, rows, logp)


def sequence_logps(model: CausalLM, batch: PairBatch, layout: ParallelLayout) -> torch.Tensor:
    """[R] summed response log-probs of each row of `batch` (R = 2B: chosen rows, then rejected rows): the trunk on
    the whole batch, then `hidden_sequence_logps`."""
    return hidden_sequence_logps(model, model.model(batch.input_ids, batch.attention_mask), batch.targets, layout)


def wpo_sequence_sums(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor,
                      layout: ParallelLayout) -> torch.Tensor:
    """[R] per row, the sum over its target tokens of WPO's adjusted log-prob log p(y_t) - log sum_v p_v^2
    (`megalign.algos.wpo_token_logps`, no gradient), from the trunk's output `hidden` [R, T, H]."""
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    head = model.lm_head
    terms = wpo_token_logps(hidden[rows, cols], head.proj.weight, targets[rows, cols],
                            layout.tp_group if layout.tp > 1 else None, head.vocab_start, head.vocab_size)
    return terms.new_zeros(targets.shape[0]).index_add(0, rows, terms)
