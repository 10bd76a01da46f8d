"""Critic-free advantage estimators of the online family, one registry (`ADVANTAGE_ESTIMATORS`, name -> function).

Every estimator maps the step's sequence rewards to per-token advantages [N, R] (0 at masked tokens)
with one signature, so the GRPO trainer (`megalign.trainers.grpo`, `algo.advantage`) calls whichever
is configured:

    fn(rewards [N], response_mask [N, R], group_size, *, eps, logp, ref_logp, kl_coef, kl_estimator,
       gamma, group) -> advantages [N, R] fp32

Groups are contiguous runs of `group_size` (the G samples of one prompt).

- "grpo", "dr_grpo", "rloo": the group-relative score of each response (`megalign.ops.group_advantages`:
  (r - mean) / (std + eps), r - mean, leave-one-out), broadcast over its tokens
  (`megalign.algos.grpo.response_advantages`). No KL in the reward.
- "reinforce_plus_plus" (REINFORCE++, Hu et al. 2025, arXiv 2501.03262; OpenRLHF's `reinforce`,
  verl's `reinforce_plus_plus`): per-token rewards with the KL penalty in them
  (`megalign.algos.ppo.token_rewards`: r_t = -kl_coef * KL_t, plus the score at the last valid
  token; KL_t k1 = log pi_old - log pi_ref by default), discounted returns
  G_t = r_t + gamma * G_{t+1} over the valid tokens (the `gae` kernel with values 0 and lam = 1,
  which is exactly that recursion), then whitened over the valid tokens of the *whole* batch of every
  rank of `group` (`megalign.algos.ppo.whiten`: (G - mean) / sqrt(var + 1e-8)).
- "reinforce_plus_plus_baseline" (REINFORCE++-baseline, same paper; OpenRLHF's `reinforce_baseline`,
  verl's `reinforce_plus_plus_baseline`): the same, after subtracting the group mean from each
  sequence reward (no division by the group std).

Conventions (and where the peers differ):

- Whitening uses verl's `masked_whiten` (unbiased variance, eps 1e-8 inside the square root);
  OpenRLHF divides by the population variance (count, not count - 1): the two differ by
  sqrt(count / (count - 1)), 0.1% at 500 tokens. Both peers whiten per rank; here the statistics are
  all-reduced over `group`, so the advantages do not depend on how the batch is split over dp.
- KL in the reward of the baseline variant: OpenRLHF (the paper's code) subtracts the group mean from
  the score and keeps -kl_coef * KL_t per token (what is done here); verl sums the per-token reward,
  KL included, into one score per response, subtracts the group mean of that and broadcasts it, so
  the KL gets no per-token credit there. With kl_coef = 0 the two are identical.
- Defaults as OpenRLHF: kl_coef 0.01, k1, gamma 1 (OpenRLHF forces gamma = 1 for the baseline
  variant; here gamma applies to both). verl defaults to no KL in the reward (kl_coef 0.001 when on).
- Holes inside a response (masked positions between valid ones) are skipped by the return
  recursion, as by `gae` (verl's loop resets the return there instead); right-padded responses, the
  only layout the online trainer produces, give the same returns either way.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from megalign.algos.grpo import response_advantages
from megalign.algos.ppo import token_rewards, whiten
from megalign.ops.gae import gae
from megalign.ops.group_advantages import group_advantages


class AdvantageEstimator(NamedTuple):
    """One registry entry: the function and whether it puts the per-token KL in the reward.

    `token_kl`: with kl_coef > 0 the estimator needs `logp` (the rollout policy's log-probs) and
    `ref_logp` (the frozen reference's), so the trainer builds the reference role.
    """

    fn: Callable[..., torch.Tensor]
    token_kl: bool


def _group_relative(mode: str) -> Callable[..., torch.Tensor]:
    def estimate(rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int, *, eps: float,
                 logp: Optional[torch.Tensor] = None, ref_logp: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                 kl_estimator: str = "k1", gamma: float = 1.0, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
        return response_advantages(rewards, response_mask, group_size, mode, eps)

    estimate.__doc__ = f"`response_advantages` in mode {mode!r} (module doc); the KL arguments are unused."
    return estimate


def discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """[N, R] fp32: G_t = r_t + gamma * G_{n(t)} over the valid tokens (n(t): the next valid one), 0 when masked.

    The `gae` kernel with values 0 and lam = 1: delta_t = r_t, A_t = r_t + gamma * A_{n(t)}, exactly.
    """
    returns, _ = gae(rewards.float(), torch.zeros_like(rewards, dtype=torch.float32), response_mask, gamma, 1.0)
    return returns


def reinforce_plus_plus(rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int, *, eps: float = 1e-6,
                        logp: Optional[torch.Tensor] = None, ref_logp: Optional[torch.Tensor] = None,
                        kl_coef: float = 0.01, kl_estimator: str = "k1", gamma: float = 1.0,
                        group: Optional[dist.ProcessGroup] = None, baseline: bool = False) -> torch.Tensor:
    """REINFORCE++ (baseline=False) or REINFORCE++-baseline advantages [N, R] fp32 (module doc).

    Args:
        rewards: [N] sequence scores. response_mask: [N, R] nonzero = a token that trains.
        group_size: G (the baseline variant subtracts each group's mean score; N % G == 0).
        logp / ref_logp: [N, R] rollout-policy and reference log-probs of the sampled tokens, or None
            (both) for no KL term; kl_coef, kl_estimator: `token_rewards`' beta and kind.
        gamma: discount of the returns. group: the dp group the batch is split over (whitening).
        eps: unused (the group std of GRPO is not taken).
    """
    scores = rewards.float()
    if baseline:
        scores = group_advantages(scores, group_size=group_size, mode="dr_grpo")
    per_token, _ = token_rewards(scores, response_mask, logp, ref_logp, kl_coef, kl_estimator)
    return whiten(discounted_returns(per_token, response_mask, gamma), response_mask, group)


def _reinforce_baseline(rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int, **kw) -> torch.Tensor:
    """`reinforce_plus_plus` with baseline=True."""
    return reinforce_plus_plus(rewards, response_mask, group_size, baseline=True, **kw)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(_group_relative("grpo"), token_kl=False),
    "dr_grpo": AdvantageEstimator(_group_relative("dr_grpo"), token_kl=False),
    "rloo": AdvantageEstimator(_group_relative("rloo"), token_kl=False),
    "reinforce_plus_plus": AdvantageEstimator(reinforce_plus_plus, token_kl=True),
    "reinforce_plus_plus_baseline": AdvantageEstimator(_reinforce_baseline, token_kl=True),
}
"""The critic-free estimators by name (module doc): the values of the GRPO trainer's `algo.advantage`."""


def estimator(name: str) -> AdvantageEstimator:
    """ADVANTAGE_ESTIMATORS[name], or a ValueError naming the bad value and the choices."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]
