"""GRPO-family objective pieces as pure tensor functions (verl `core_algos` style).

GRPO (Shao et al. 2024, DeepSeekMath) samples G responses per prompt, scores them with a verifier,
normalises each score within its group and maximises the clipped surrogate of PPO with those
advantages on every response token. Its descendants change a few pieces, each chosen here by name
(loss aggregation, shared by every online algorithm, is `megalign.algos.aggregation`):

- advantages (`response_advantages`): `megalign.ops.group_advantages` in mode grpo (std-normalised),
  dr_grpo (mean-centred only) or rloo (leave-one-out), broadcast over the response tokens; the
  trainers pick estimators from `megalign.algos.advantages.ADVANTAGE_ESTIMATORS`, which holds these
  three and REINFORCE++.
- dynamic sampling (`informative_groups`, DAPO): a group whose rewards are all equal has zero
  advantage everywhere and contributes no gradient, so it is dropped and replaced.
- overlong handling (`overlong_mask`, `overlong_penalty`, DAPO section 3.4): a response cut at the
  length limit has no final answer, so its reward is noise. Either mask it out of the loss
  ("truncate-and-mask", DAPO's overlong filtering), or add the soft length penalty that ramps from
  0 to -1 over the last `buffer` tokens before the limit.
"""
from __future__ import annotations

import torch

from megalign.ops.group_advantages import group_advantages


def response_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int, mode: str = "grpo",
                        eps: float = 1e-6) -> torch.Tensor:
    """Per-token advantages [N, T]: group-normalised rewards broadcast over each response's tokens.

    Args:
        rewards: [N] one scalar per response; groups are contiguous runs of `group_size` (the G
            samples of one prompt).
        response_mask: [N, T] response tokens (nonzero = valid); advantages are 0 elsewhere.
        mode: "grpo" (r - mean) / (std + eps) as in Shao et al. 2024; "dr_grpo" r - mean (Liu et al.
            2025, no std scaling); "rloo" leave-one-out baseline (`megalign.ops.group_advantages`).
    """
    scores = group_advantages(rewards.float(), group_size=group_size, mode=mode, eps=eps)
    return scores[:, None] * (response_mask != 0).to(scores.dtype)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N / G] bool: True for groups whose rewards are not all equal (DAPO's dynamic sampling keeps those).

    A group of equal rewards has advantage exactly 0 in every mode, so it only dilutes the batch.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size}, got {tuple(rewards.shape)}")
    groups = rewards.view(-1, group_size)
    return groups.amax(-1) != groups.amin(-1)


def overlong_mask(response_mask: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
    """Truncate-and-mask (DAPO's overlong filtering): zero the mask [N, T] of responses that did not finish.

    `finished` [N] bool: the response ended with EOS (or a stop token) within the length limit.
    """
    return response_mask * finished[:, None].to(response_mask.dtype)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward: [N] float.

        0                                   if L <= max_length - buffer
        (max_length - buffer - L) / buffer  if max_length - buffer < L <= max_length
        -1                                  if L > max_length

    `lengths` [N] are response lengths in tokens; 0 < buffer <= max_length.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    excess = lengths.float() - (max_length - buffer)
    return (-excess / buffer).clamp(min=-1.0, max=0.0)
