"""PPO with a critic as pure tensor functions (verl `core_algos` style): token rewards, GAE, whitening,
value loss, KL control.

RLHF's PPO (Ouyang et al. 2022, InstructGPT; Stiennon et al. 2020; Ziegler et al. 2019) turns one
sequence-level score into per-token rewards, estimates per-token advantages with the critic by GAE
(Schulman et al. 2016) and optimises the clipped surrogate (Schulman et al. 2017) for the actor and a
clipped regression for the critic:

    token_rewards   r_t = -beta * KL_t  (+ score at the last response token) (+ step rewards)  [N, R]
                    score = clip((s - mu) / sigma, +-c)  (optional RM normalisation and clip)
    gae             delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1}
                    returns R_t = A_t + V_t                          (`megalign.ops.gae`)
    whiten          A <- (A - mean) / sqrt(var + 1e-8) over the valid tokens of the whole batch of
                    every dp rank (verl's `masked_whiten`, unbiased var, mean shifted back in or not)
    value_loss      0.5 * max((V - R)^2, (V_clip - R)^2),  V_clip = V_old + clamp(V - V_old, +-eps_v)
    policy loss     `megalign.ops.policy_loss` (clip, clip-higher, dual clip, optional k3 term)
    KL control      fixed beta, or Ziegler et al.'s adaptive controller (`AdaptiveKL`)
    diagnostics     the critic's explained variance 1 - Var(R - V) / Var(R), value error, the advantages'
                    mean / std before whitening, from masked sums reduced over dp (`critic_diagnostics`)

Conventions (and the peers'):

- The KL penalty sits either in the reward (`kl_in_reward`: -beta * KL_t per token, with KL_t the
  k1 estimate log pi - log pi_ref as InstructGPT / TRL / OpenRLHF, `abs` as NeMo-Aligner, or k3) or
  in the loss (beta * k3 per token as GRPO; `low_var_kl` as verl); `megalign.trainers.ppo` selects.
- gamma = 1, lam = 0.95 by default (InstructGPT / TRL); verl and OpenRLHF now default lam = 1.
- Whitening is global over dp (the issue's requirement and what a single-device run computes); verl
  and OpenRLHF whiten per rank, which makes the advantages depend on the split. Statistics are sums
  all-reduced in float64, two passes (mean first, then the squared deviations).
- The score is placed at the last *valid* response token (InstructGPT); responses with no valid token
  get no reward.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megalign.ops.gae import gae
from megalign.ops.kl_penalty import kl_penalty

KL_IN_REWARD = ("k1", "abs", "k3")
"""Per-token KL estimators accepted by `token_rewards` (names as `megalign.ops.kl_penalty`)."""


def _check_2d(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)} (the response mask's), got {tuple(t.shape)}")


def last_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N, R] fp32: `scores` [N] placed at each response's last valid token (0 elsewhere; all-masked rows 0)."""
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be [N] and response_mask [N, R], got {tuple(scores.shape)} and "
                         f"{tuple(response_mask.shape)}")
    valid = response_mask != 0
    steps = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, steps, -1).amax(-1)  # -1: no valid token
    out = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    rows = torch.nonzero(last >= 0)[:, 0]
    out[rows, last[rows]] = scores.float()[rows]
    return out


def normalize_scores(scores: torch.Tensor, mean: Optional[float] = None, std: Optional[float] = None,
                     clip: Optional[float] = None) -> torch.Tensor:
    """[N] fp32: (scores - mean) / std with the RM's stored statistics (when given), then clamped to +-clip.

    OpenRLHF's order (normalise the RM output, then `reward_clip_range`); InstructGPT normalises the
    RM so that its reference outputs average 0.
    """
    out = scores.float()
    if (mean is None) != (std is None):
        raise ValueError("normalize_scores: give both mean and std, or neither")
    if mean is not None:
        if not std > 0:
            raise ValueError(f"normalize_scores: std must be > 0, got {std}")
        out = (out - mean) / std
    if clip is not None:
        if not clip > 0:
            raise ValueError(f"normalize_scores: clip must be > 0, got {clip}")
        out = out.clamp(-clip, clip)
    return out


def token_rewards(scores: torch.Tensor, response_mask: torch.Tensor, logp: Optional[torch.Tensor] = None,
                  ref_logp: Optional[torch.Tensor] = None, beta: float = 0.0, kind: str = "k1", *,
                  step_rewards: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards with the KL penalty in the reward: (rewards [N, R], kl [N, R]), both fp32.

    Args:
        scores: [N] sequence scores (already normalised / clipped: `normalize_scores`).
        response_mask: [N, R] nonzero = a response token that trains.
        logp / ref_logp: [N, R] log-probs of the sampled tokens under the rollout policy and the
            reference; None (both) for no KL term.
        beta: KL coefficient; kind: one of KL_IN_REWARD.
        step_rewards: [N, R] per-token rewards added on the valid tokens, e.g. process rewards at the
            end of each step (`megalign.algos.reward_shaping`); None: none.

    rewards_t = -beta * KL_t on valid tokens, plus the score at the last valid token, plus
    step_rewards_t; kl is KL_t on valid tokens, 0 elsewhere (for the controller and the logs).
    """
    if kind not in KL_IN_REWARD:
        raise ValueError(f"token_rewards: kind must be one of {KL_IN_REWARD}, got {kind!r}")
    if not math.isfinite(beta) or beta < 0:
        raise ValueError(f"token_rewards: beta must be finite and >= 0, got {beta}")
    valid = (response_mask != 0).float()
    rewards = last_token_rewards(scores, response_mask)
    if step_rewards is not None:
        _check_2d("step_rewards", step_rewards, response_mask)
        rewards = rewards + step_rewards.float() * valid
    if (logp is None) != (ref_logp is None):
        raise ValueError("token_rewards: give both logp and ref_logp, or neither")
    if logp is None:
        return rewards, torch.zeros_like(rewards)
    _check_2d("logp", logp, response_mask)
    _check_2d("ref_logp", ref_logp, response_mask)
    kl = kl_penalty(logp.detach(), ref_logp.detach(), kind).float() * valid
    return rewards - beta * kl, kl


def advantages_and_returns(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                           gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the response tokens (`megalign.ops.gae`, masked tokens skipped): (advantages, returns) [N, R] fp32."""
    _check_2d("values", values, response_mask)
    return gae(rewards.float(), values.float(), response_mask, gamma, lam)


def whiten(values: torch.Tensor, mask: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
           shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the valid entries of every rank of `group`; 0 at masked entries.

    Args:
        values: [N, R] (any float dtype); mask: [N, R] nonzero = valid.
        group: the dp group the batch is split over (None or size 1: this rank only).
        shift_mean: False adds the mean back (verl's `shift_mean=False`).

    verl's `masked_whiten`: mean and the unbiased variance (count / (count - 1)) over the valid
    entries; here both are global over `group` (module doc), so dp=2 gives what dp=1 gives on the
    concatenated batch. Fewer than 2 valid entries in all: the variance is taken as 0.
    """
    _check_2d("values", values, mask)
    valid = (mask != 0).double()
    x = values.double()

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        return t

    sums = reduce(torch.stack([(x * valid).sum(), valid.sum()]))
    count = sums[1]
    mean = sums[0] / count.clamp(min=1)
    squares = reduce(((x - mean) ** 2 * valid).sum())
    var = torch.where(count > 1, squares / (count - 1).clamp(min=1), torch.zeros_like(squares))
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return (out * valid).to(torch.float32 if values.dtype != torch.float64 else torch.float64)


class ValueLossStats(NamedTuple):
    """0-d fp32 sums over the valid tokens (no host sync): clipped tokens (the clipped branch was larger)
    and the token count; the clip fraction is clipped / count."""

    clipped: torch.Tensor
    count: torch.Tensor


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: Optional[float] = 0.2) -> tuple[torch.Tensor, ValueLossStats]:
    """Per-token clipped value loss [N, R] fp32 (0 at masked tokens) and its stats.

        V_clip = V_old + clamp(V - V_old, -eps_v, eps_v)
        loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)

    (PPO2's value clip, as verl's `compute_value_loss` and trlx; `cliprange_value=None`: the plain
    0.5 (V - R)^2). Aggregate with `megalign.algos.aggregation.aggregate_loss`. Gradient: w.r.t. `values` only.
    """
    for name, t in (("old_values", old_values), ("returns", returns), ("values", values)):
        _check_2d(name, t, mask)
    valid = (mask != 0).float()
    v, old, ret = values.float(), old_values.detach().float(), returns.detach().float()
    unclipped = (v - ret) ** 2
    if cliprange_value is None:
        return 0.5 * unclipped * valid, ValueLossStats(torch.zeros((), device=v.device), valid.sum())
    if not cliprange_value > 0:
        raise ValueError(f"value_loss: cliprange_value must be > 0 or None, got {cliprange_value}")
    clipped_v = old + (v - old).clamp(-cliprange_value, cliprange_value)
    clipped = (clipped_v - ret) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped) * valid
    return loss, ValueLossStats(((clipped > unclipped).float() * valid).sum().detach(), valid.sum())


def critic_diagnostic_sums(values: torch.Tensor, returns: torch.Tensor, advantages: torch.Tensor,
                           mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """0-d fp64 masked sums over the valid tokens, to add to `MetricSums` and reduce over dp, from which
    `critic_diagnostics` makes the critic's health metrics.

    Args:
        values: [N, R] the critic's values at rollout time (the ones GAE used); returns: [N, R] GAE's targets;
        advantages: [N, R] GAE's advantages before whitening; mask: [N, R] nonzero = valid.

    Sums of r, r^2, e = r - v, e^2, |e|, A, A^2 and the token count: every moment the metrics need is a
    sum, so dp ranks add theirs and the result is the whole batch's (not a mean of per-rank ratios).
    """
    for name, t in (("values", values), ("returns", returns), ("advantages", advantages)):
        _check_2d(name, t, mask)
    valid = (mask != 0).double()
    ret, adv = returns.detach().double() * valid, advantages.detach().double() * valid
    error = ret - values.detach().double() * valid
    return {"tokens": valid.sum(), "return": ret.sum(), "return_sq": (ret ** 2).sum(), "error": error.sum(),
            "error_sq": (error ** 2).sum(), "error_abs": error.abs().sum(), "advantage": adv.sum(),
            "advantage_sq": (adv ** 2).sum()}


def critic_diagnostics(sums: dict[str, float]) -> dict[str, float]:
    """The critic's metrics from `critic_diagnostic_sums` reduced over dp (verl's names where it has them):

        critic/vf_explained_var   1 - Var(r - v) / Var(r)   (verl; 1: perfect, 0: no better than the mean
                                  return, < 0: worse; population variances, so the (n - 1) factors cancel)
        critic/vf_mse, vf_mae     mean (v - r)^2 and mean |v - r|
        critic/advantages/mean    mean and unbiased std of GAE's advantages before whitening (verl logs
        critic/advantages/std     them after; before is what shows a biased critic)

    With fewer than 2 valid tokens or constant returns the explained variance is 0 (nothing to explain).
    """
    n = sums["tokens"]
    if n < 1:
        return {"critic/vf_explained_var": 0.0, "critic/vf_mse": 0.0, "critic/vf_mae": 0.0,
                "critic/advantages/mean": 0.0, "critic/advantages/std": 0.0}
    var_return = sums["return_sq"] / n - (sums["return"] / n) ** 2
    var_error = sums["error_sq"] / n - (sums["error"] / n) ** 2
    adv_mean = sums["advantage"] / n
    adv_var = (sums["advantage_sq"] - n * adv_mean ** 2) / (n - 1) if n > 1 else 0.0
    return {"critic/vf_explained_var": 1.0 - var_error / var_return if var_return > 1e-12 else 0.0,
            "critic/vf_mse": sums["error_sq"] / n, "critic/vf_mae": sums["error_abs"] / n,
            "critic/advantages/mean": adv_mean, "critic/advantages/std": math.sqrt(max(adv_var, 0.0))}


def sequence_mean_kl(kl: torch.Tensor, mask: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """0-d fp64: the per-token KL averaged over each response's valid tokens, then over the responses of
    every rank of `group` (verl's `current_kl` for the adaptive controller); responses with no valid
    token are left out."""
    valid = (mask != 0).double()
    per_seq = (kl.double() * valid).sum(-1) / valid.sum(-1).clamp(min=1)
    has = (valid.sum(-1) > 0).double()
    sums = torch.stack([(per_seq * has).sum(), has.sum()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return sums[0] / sums[1].clamp(min=1)


class AdaptiveKL:
    """Ziegler et al. 2019, section 2.2 (trlx / verl `AdaptiveKLController`): after each step,

        e = clip(KL / target - 1, -0.2, 0.2);   beta <- beta * (1 + e * n / horizon)

    with KL the step's measured KL and n the number of samples of the step. `target=None` keeps
    beta fixed. `state` ({"beta": float}) is what a checkpoint holds.
    """

    def __init__(self, beta: float, target: Optional[float] = None, horizon: float = 10000.0):
        if not math.isfinite(beta) or beta < 0:
            raise ValueError(f"AdaptiveKL: beta must be finite and >= 0, got {beta}")
        if target is not None and not target > 0:
            raise ValueError(f"AdaptiveKL: target must be > 0 or None, got {target}")
        if not horizon > 0:
            raise ValueError(f"AdaptiveKL: horizon must be > 0, got {horizon}")
        self.target, self.horizon = target, horizon
        self.state = {"beta": float(beta)}

    @property
    def beta(self) -> float:
        return self.state["beta"]

    def update(self, kl: float, n_samples: int) -> float:
        """Apply one step's measured `kl` over `n_samples` samples; returns the new beta."""
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.state["beta"] = self.beta * (1.0 + error * n_samples / self.horizon)
        return self.beta
