"""Rewards beyond one weighted score per response, as pure tensor functions: Llama 2's gated safety /
helpfulness pair, a reward-model ensemble's mean or minimum, sequence-level whitening over every dp rank, and
process (step) rewards placed where each step of a response ends.

Gated pair (Touvron et al. 2023, Llama 2, §3.2.2 and §3.2.4):

    R_c(g|p)  = R_s(g|p)  if IS_SAFETY(p) or R_s(g|p) < 0.15,  else R_h(g|p)
    R~_c(g|p) = WHITEN(LOGIT(R_c(g|p)))
    R(g|p)    = R~_c(g|p) - beta * KL(pi_theta(g|p) || pi_0(g|p))      (`megalign.algos.ppo.token_rewards`)

In the paper R_s and R_h live in sigmoid space (the 0.15 threshold is a probability, "corresponding to
a precision of 0.89 and recall of 0.55 on the Meta Safety test set"), and LOGIT reverses the sigmoid to
get back "the final linear scores" before whitening. megalign's reward models (`RewardModel`, the
Bradley-Terry head of `megalign.trainers.preference`) output the linear score x itself, so here
R = sigmoid(x): the gate compares sigmoid(x_s) with the threshold (equivalently x_s < logit(0.15)),
and LOGIT(R_c) is the chosen model's raw score exactly, logit(sigmoid(x)) = x, without the round trip
(which saturates in fp32 once sigmoid rounds to 1, |x| > ~17). `gated_reward` returns that LOGIT(R_c);
`whiten_scores` is WHITEN over the global batch.

Ensemble (Coste et al. 2024, "Reward Model Ensembles Help Mitigate Overoptimization"): K reward models trained
apart (seeds, data) err apart, so a policy that climbs one model's error is not rewarded by the others. Each
member's score is first standardised with its own held-out mean and std (the scales of separately trained
Bradley-Terry models are arbitrary), then reduced over the members: the mean, or the minimum (their "worst-case
optimisation", the conservative one). The members' spread (population std of the standardised scores) is their
disagreement, the uncertainty a user watches.

Process rewards (Lightman et al. 2023; Math-Shepherd, Wang et al. 2024, whose PPO rewards each step at
its end): a PRM (`megalign.trainers.prm`) gives p(correct) at the token that ends a step, so the
per-token reward [N, R] holds one value at each step end and GAE (`megalign.algos.ppo`) assigns credit
per step; an outcome score still sits at the last token (`token_rewards(..., step_rewards=...)` adds
both). `step_ends` finds the steps in the response token ids the way the PRM was trained
(`megalign.data.stepwise`): a step ends at the last token of the separator's encoding, steps are never
empty, and a finished response's last step, which ends in EOS rather than a separator, ends at its EOS
(the PRM reads it with the separator in place of the EOS, `prm_inputs`, which is what it was trained on);
an unfinished (truncated) response's incomplete last step gets no step reward.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megalign.algos.ppo import normalize_scores, whiten


def gated_reward(safety: torch.Tensor, helpful: torch.Tensor, is_safety: torch.Tensor,
                 threshold: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """LOGIT(R_c) of Llama 2's gate (module doc) from the two reward models' linear scores: ([N] fp32, bool [N]).

    Args:
        safety, helpful: [N] raw scores (logits) of the safety and the helpfulness reward model.
        is_safety: bool [N], the prompt is a safety prompt (a dataset field).
        threshold: the gate on sigmoid(safety), in (0, 1).

    Returns the safety model's score where `is_safety` or sigmoid(safety) < threshold, else the
    helpfulness model's score; and the bool [N] mask of the rows that took the safety branch.
    """
    if not 0 < threshold < 1:
        raise ValueError(f"gated_reward: threshold must be in (0, 1) (a probability), got {threshold}")
    if not (safety.shape == helpful.shape == is_safety.shape) or safety.dim() != 1:
        raise ValueError(f"gated_reward: safety, helpful and is_safety must all be [N], got {tuple(safety.shape)}, "
                         f"{tuple(helpful.shape)} and {tuple(is_safety.shape)}")
    use_safety = is_safety.bool() | (torch.sigmoid(safety.double()) < threshold)
    return torch.where(use_safety, safety.float(), helpful.float()), use_safety


ENSEMBLE_REDUCTIONS = ("mean", "min")
"""How `ensemble_reward` combines the members' standardised scores (module doc)."""


def ensemble_reward(scores: torch.Tensor, means: Sequence[float], stds: Sequence[float],
                    reduce: str = "min") -> tuple[torch.Tensor, torch.Tensor]:
    """(reduced [N], spread [N]) fp32 of K reward models' raw scores `scores` [K, N] (module doc): each row
    standardised (s_k - mean_k) / std_k with its model's statistics (`megalign.algos.ppo.normalize_scores`, which
    refuses a std <= 0), then the mean or the minimum over k, and the population std over k."""
    if reduce not in ENSEMBLE_REDUCTIONS:
        raise ValueError(f"ensemble_reward: reduce must be one of {ENSEMBLE_REDUCTIONS}, got {reduce!r}")
    if scores.dim() != 2 or not len(means) == len(stds) == scores.shape[0] >= 2:
        raise ValueError(f"ensemble_reward: scores must be [K >= 2, N] with K means and stds, got "
                         f"{tuple(scores.shape)}, {len(means)} means and {len(stds)} stds")
    z = torch.stack([normalize_scores(row, mean, std) for row, mean, std in zip(scores, means, stds)])
    reduced = z.mean(0) if reduce == "mean" else z.min(0).values
    return reduced, z.std(0, correction=0)


def missing_eos_penalty(rewards: torch.Tensor, finished: torch.Tensor, penalty: float) -> torch.Tensor:
    """[N] `rewards` less `penalty` where bool [N] `finished` is False (a response cut before its EOS; TRL's
    `missing_eos_penalty`, `megalign.trainers.online_config.MissingEOSPenalty`)."""
    return rewards - penalty * (~finished).to(rewards.dtype)


def whiten_scores(scores: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """[N] fp32: WHITEN of sequence scores over the responses of every rank of `group`.

    `megalign.algos.ppo.whiten` on [N, 1] (mean and unbiased variance of the global batch, eps 1e-8),
    so dp=2 whitens as dp=1 does on the concatenated batch.
    """
    if scores.dim() != 1:
        raise ValueError(f"whiten_scores: scores must be [N], got {tuple(scores.shape)}")
    column = scores[:, None]
    return whiten(column, torch.ones_like(column), group)[:, 0]


def step_ends(response_ids: torch.Tensor, response_mask: torch.Tensor, separator_ids: Sequence[int],
              eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the steps of each response end (module doc): (ends bool [N, R], eos_step bool [N]).

    Args:
        response_ids / response_mask: [N, R] right-padded response tokens (mask nonzero = a token).
        separator_ids: the tokenizer's encoding of the step separator (one or more ids).
        eos_id: the end-of-sequence id; a response whose last valid token is EOS is finished.

    `ends[n, j]` is True where a non-empty step ends: at the last token of a separator occurrence
    (found left to right, not overlapping), and at the EOS of a finished response whose last step is
    not already closed by a separator; `eos_step[n]` says that row's last step ends at its EOS.
    """
    separator = [int(i) for i in separator_ids]
    if not separator:
        raise ValueError("step_ends: separator_ids must hold at least one token id")
    if response_ids.shape != response_mask.shape or response_ids.dim() != 2:
        raise ValueError(f"step_ends: response_ids and response_mask must both be [N, R], got "
                         f"{tuple(response_ids.shape)} and {tuple(response_mask.shape)}")
    ends = torch.zeros(response_ids.shape, dtype=torch.bool)
    eos_step = torch.zeros(response_ids.shape[0], dtype=torch.bool)
    width = len(separator)
    lengths = (response_mask != 0).sum(-1).tolist()
    for n, (row, length) in enumerate(zip(response_ids.tolist(), lengths)):
        finished = length > 0 and row[length - 1] == eos_id
        body = length - 1 if finished else length
        j, step_start = 0, 0  # step_start: first token of the current step
        while j + width <= body:
            if row[j:j + width] == separator:
                if j > step_start:
                    ends[n, j + width - 1] = True
                j += width
                step_start = j
            else:
                j += 1
        if finished and body > step_start:
            ends[n, length - 1] = True
            eos_step[n] = True
    return ends.to(response_ids.device), eos_step.to(response_ids.device)


def prm_inputs(sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int, ends: torch.Tensor,
               eos_step: torch.Tensor, separator_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the PRM reads for `step_ends`' steps: (input ids, attention mask, where) [N, P + R + len(sep) - 1].

    The sequences [N, P + R] (left-padded prompt, right-padded response of width R) with, in rows whose
    last step ends at EOS, the separator written from the EOS position on (the PRM was trained on steps
    that each end in the separator); `where` marks the last token of every step's separator. Its True
    entries, in row-major order, correspond one to one with those of `ends` [N, R].
    """
    separator = torch.as_tensor(list(separator_ids), dtype=sequences.dtype, device=sequences.device)
    extra = separator.numel() - 1
    ids = torch.nn.functional.pad(sequences, (0, extra))
    mask = torch.nn.functional.pad(attention_mask, (0, extra))
    prompt = sequences.shape[1] - response_width
    where = torch.nn.functional.pad(ends, (prompt, extra))
    rows = torch.nonzero(eos_step)[:, 0].tolist()
    if rows:
        last = (attention_mask[:, prompt:] != 0).sum(-1) - 1  # the EOS position in the response
        for n in rows:
            start = prompt + int(last[n])
            ids[n, start:start + separator.numel()] = separator
            mask[n, start:start + separator.numel()] = 1
            where[n, start] = False
            where[n, start + extra] = True
    return ids, mask, where


STEP_SCORES = ("prob", "centered")
"""How a step's p(correct) becomes its reward: p itself (Math-Shepherd), or p - 1/2 (a step judged wrong
costs and one judged right pays, so adding steps earns nothing by itself)."""


def place_step_scores(probs: torch.Tensor, ends: torch.Tensor, step_score: str = "prob") -> torch.Tensor:
    """[N, R] fp32: the S step probabilities `probs` [S] (row-major order of `ends`) at the True entries of
    `ends` bool [N, R], transformed by `step_score` (one of STEP_SCORES); 0 elsewhere."""
    if step_score not in STEP_SCORES:
        raise ValueError(f"place_step_scores: step_score must be one of {STEP_SCORES}, got {step_score!r}")
    count = int(ends.sum())
    if probs.shape != (count,):
        raise ValueError(f"place_step_scores: probs must be [{count}] (one per step end), got {tuple(probs.shape)}")
    out = torch.zeros(ends.shape, dtype=torch.float32, device=ends.device)
    out[ends] = probs.float().to(ends.device) - (0.5 if step_score == "centered" else 0.0)
    return out

