"""Process reward models: a correctness score for every reasoning step, as pure tensor functions.

A PRM reads a solution whose steps end in a separator token and classifies the hidden state at
each separator as "the solution is still on a correct path" or not (Lightman et al. 2023, arXiv
2305.20050, with human step labels; Math-Shepherd, Wang et al. 2024, arXiv 2312.08935, with
Monte-Carlo labels). Two heads:

- a 2-way classifier on the hidden states: logits [B, T, 2], class 1 = correct (`prm_loss`);
- "reward tokens" on the LM head (Math-Shepherd, OpenRLHF): the logits of two vocabulary tokens
  (e.g. "+" and "-") at the separator, a softmax over just those two (`prm_token_loss`).

Labels [B, T] are float: IGNORE_INDEX (-100) at every position that is not a step separator
(prompt, step text, padding), and at a separator either a hard label in {0, 1} or a soft label in
[0, 1] (the fraction of Monte-Carlo completions from that step that reach the right answer,
`math_shepherd_labels`). The per-step loss is the cross-entropy with the target distribution
(1 - y, y), -(y log p_1 + (1 - y) log p_0); for hard labels that is the usual cross-entropy.

The natural unit is the step, so the functions return the *sum* of the step losses (a 0-d tensor)
and the number of steps: the trainer all-reduces the count over the data-parallel group and
divides, which gives the mean over every step of the global batch. No host sync.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megalign.algos.common import MetricSum, compute_dtype

IGNORE_INDEX = -100
"""The label of a position that is not a step separator."""


class PRMStats(NamedTuple):
    """0-d counts over this call's steps (detached, in the compute dtype)."""

    num_steps: torch.Tensor
    """Positions whose label is not IGNORE_INDEX: the denominator of the loss."""
    num_correct: torch.Tensor
    """Steps whose prediction (p_1 > 1/2) matches the label (y > 1/2; a soft label of exactly 1/2 counts as 0)."""

    def metrics(self) -> dict[str, MetricSum]:
        return {"step_accuracy": MetricSum(self.num_correct, self.num_steps)}


def prm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, PRMStats]:
    """Step-level cross-entropy of a 2-way PRM head.

    Args:
        logits: [B, T, 2] (class 0 = incorrect, 1 = correct), any float dtype; computed in fp32.
        labels: [B, T] float: IGNORE_INDEX off the steps, a hard {0, 1} or soft [0, 1] label at each step.
            Values are not checked here (that would sync); `math_shepherd_labels` builds valid ones.

    Returns: (the sum of the step losses, 0-d; PRMStats). Divide by the global number of steps.
    """
    if logits.dim() != 3 or logits.shape[-1] != 2:
        raise ValueError(f"logits must be [batch, tokens, 2], got {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must be [batch, tokens] = {tuple(logits.shape[:2])} like logits, "
                         f"got {tuple(labels.shape)}")
    logp = torch.log_softmax(logits.to(compute_dtype(logits)), dim=-1)
    steps = labels != IGNORE_INDEX
    y = torch.where(steps, labels.to(logp.dtype), torch.zeros((), dtype=logp.dtype, device=logp.device))
    per_step = -(y * logp[..., 1] + (1 - y) * logp[..., 0])
    loss_sum = torch.where(steps, per_step, torch.zeros_like(per_step)).sum()
    correct = ((logp[..., 1] > logp[..., 0]) == (y > 0.5)) & steps
    return loss_sum, PRMStats(steps.sum().to(logp.dtype), correct.sum().to(logp.dtype))


def prm_token_loss(lm_logits: torch.Tensor, labels: torch.Tensor, *, positive_token_id: int,
                   negative_token_id: int) -> tuple[torch.Tensor, PRMStats]:
    """`prm_loss` on the LM head's logits of two reward tokens (the softmax is over those two only).

    Args:
        lm_logits: [B, T, V] full-vocabulary logits at every position (gather the two columns from
            a vocab-parallel head before calling).
        labels: [B, T] as for `prm_loss`.
        positive_token_id, negative_token_id: the distinct vocabulary ids meaning "correct" / "incorrect".
    """
    if lm_logits.dim() != 3:
        raise ValueError(f"lm_logits must be [batch, tokens, vocab], got {tuple(lm_logits.shape)}")
    vocab = lm_logits.shape[-1]
    for name, token in (("positive_token_id", positive_token_id), ("negative_token_id", negative_token_id)):
        if not (isinstance(token, int) and 0 <= token < vocab):
            raise ValueError(f"{name} must be a token id in [0, {vocab}), got {token!r}")
    if positive_token_id == negative_token_id:
        raise ValueError(f"positive_token_id and negative_token_id must differ, both are {positive_token_id}")
    return prm_loss(lm_logits[..., [negative_token_id, positive_token_id]], labels)


def math_shepherd_labels(reached: torch.Tensor, mode: str = "soft") -> torch.Tensor:
    """Monte-Carlo step labels of Math-Shepherd (Wang et al. 2024, arXiv 2312.08935): [S] float.

    Args:
        reached: [S, N] bool; reached[s, n] is True when the n-th of N completions sampled from the
            solution prefix ending at step s reaches the correct final answer.
        mode: "soft" (SE: the fraction of the N completions that reach it) or "hard" (HE: 1 if any does).
    """
    if not isinstance(reached, torch.Tensor) or reached.dtype != torch.bool or reached.dim() != 2:
        raise ValueError(f"reached must be a bool tensor [steps, completions], got "
                         f"{(reached.dtype, tuple(reached.shape)) if isinstance(reached, torch.Tensor) else reached!r}")
    if reached.shape[1] == 0:
        raise ValueError("reached must hold at least one completion per step, got [steps, 0]")
    if mode == "soft":
        return reached.float().mean(-1)
    if mode == "hard":
        return reached.any(-1).float()
    raise ValueError(f"unknown mode {mode!r}; one of soft, hard")
