"""Off-policy correction of the policy-gradient loss (`algo.off_policy` of GRPO and PPO): importance weights between
the *proximal* policy, whose log-probs the trainer recomputes at the start of the update (`rollout.old_logprobs:
recompute`, `batch.old_logp`), and the *behaviour* policy that sampled the tokens (the rollout engine's log-probs,
`batch.rollout_logp`).

In the synchronous trainers the two are the same weights run by two code paths (the engine's KV-cache decode and
the training forward), so they differ by rounding (`megalign.rollout.mismatch` measures it every step): that is the
rollout / trainer mismatch verl, NeMo-RL and others patch with TIS / MIS. When rollouts come from older weights the
same weights correct the staleness; nothing here assumes the two policies are close.

Per response token t (valid where the response mask is set), all weights detached (constants of the step, computed
once per step from the two log-probs, so every epoch and micro-batch of the step uses the same ones):

    w_t = exp(clamp(log pi_prox(a_t) - log pi_behav(a_t), -20, 20))

and, with L_t the chosen policy loss (`algo.policy_loss`: the PPO surrogate, CISPO, GSPO) on the ratio pi_theta /
pi_prox, the actor trains on weight_t * L_t over the tokens of `mask` (the loss's mask and the aggregation's
denominator, `megalign.algos.aggregation`):

    mode       weight_t                     tokens left out of the loss (mask)          after
    none       1                            none                                       (today's loss, bit for bit)
    tis        min(w_t, C)                  none                                       Yao et al. 2025 (verl's
                                                                                       tis_imp_ratio_cap; rollout_is
                                                                                       level token, mode truncate)
    mis        w_t if w_t <= C else 0       w_t > C (out of the denominator too)       Yao et al. 2025's masked IS;
                                                                                       verl's rollout_is mode mask
    seq_mask   1                            whole responses whose ratio s_i leaves      verl's rollout_rs (geometric:
                                            the band [lo, hi]                          "geo_rs"; product: sequence)
    decoupled  w_t if w_t <= C else 0       none (the zeroed tokens stay in the        AReaL's decoupled PPO (Fu et
                                            denominator, as AReaL normalises)          al. 2025, arXiv 2505.24298)

C is `cap`, [lo, hi] `band`. seq_mask's s_i (`seq_ratio`) is the geometric mean exp(mean_t log w_t) of response
i's token ratios (default: length-independent, so one band fits every length; verl's "geometric" level) or their
product exp(sum_t log w_t) (the true sequence importance ratio; verl's "sequence" level; it needs a far wider band).
A response with no valid token is never dropped.

The decoupled objective is loss_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) with r_t =
pi_theta / pi_prox, which is the PPO surrogate the trainers already compute (their old log-probs are the proximal
ones) times the capped behaviour weight; AReaL's `behav_imp_weight_cap` drops a token above the cap ("we filter out
the tokens where behav_imp_weight exceeds behav_imp_weight_cap") but keeps it in its token count, which is what
tells it apart from mis here. It is defined on the PPO clip, so it needs `policy_loss: ppo`; tis / mis / seq_mask
weigh any policy loss. In the synchronous trainers the proximal policy (the weights before this step's update) is
the behaviour policy up to rounding; with stale rollouts it is the version before the update, as in the paper.

The weight multiplies the policy-gradient term only (verl applies rollout_is weights to pg_losses alone): the KL to
the reference in the loss and the entropy bonus are added unweighted; the critic's value loss (PPO) is unweighted.
Online DPO has no `off_policy`: its pairwise loss is a function of the current and reference policies on given
pairs, with no ratio to the sampler and no use of the rollout's log-probs, so there is nothing to reweigh.

Metrics (`off_policy_metrics`, per step, reduced over dp):

    offpolicy/weight_mean       mean of the raw ratio before cap: w_t over the response tokens (tis, mis,
                                decoupled), s_i over the responses with a token (seq_mask)
    offpolicy/weight_max        its largest value
    offpolicy/truncated_frac    fraction of response tokens whose weight the cap truncated (tis)
    offpolicy/masked_frac       fraction of response tokens whose loss was dropped (mis, seq_mask, decoupled)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Literal, NamedTuple, Optional

import torch

from megalign.config import option
from megalign.ops.common import LOG_RATIO_BOUND
from megalign.ops.kl_penalty import kl_penalty

MODES = ("none", "tis", "mis", "seq_mask", "decoupled")
METRICS = ("offpolicy/weight_max", "offpolicy/weight_mean", "offpolicy/truncated_frac", "offpolicy/masked_frac")
MODE_POLICY_LOSSES = {"decoupled": ("ppo",)}
"""Modes defined on some policy losses only (the others weigh any)."""


@dataclasses.dataclass
class OffPolicyConfig:
    """`algo.off_policy`: which correction (module doc), its cap and band."""

    mode: Literal["none", "tis", "mis", "seq_mask", "decoupled"] = option(
        "none", doc="none: no correction; tis: weight min(w, cap); mis: weight w, tokens with w > cap out of the loss; "
                    "seq_mask: responses whose ratio leaves band out of the loss; decoupled: AReaL's decoupled PPO "
                    "(weight w, 0 above cap; policy_loss=ppo). w = pi_prox / pi_behav per token (the recomputed "
                    "old log-probs over the rollout's): every mode but none needs rollout.old_logprobs=recompute")
    cap: float = option(2.0, doc="C of tis, mis and decoupled (>= 1; Yao et al.'s 2, verl's rollout_is_threshold "
                                 "default; AReaL's behav_imp_weight_cap examples use 5)")
    band: list[float] = option([0.999, 1.001], doc="seq_mask: [lo, hi], lo <= 1 <= hi; a response whose ratio leaves it "
                                                   "is dropped (the default suits seq_ratio=geometric: verl's 1.001 and "
                                                   "about its reciprocal)")
    seq_ratio: Literal["geometric", "product"] = option(
        "geometric", doc="seq_mask: a response's ratio is the geometric mean of its token ratios (length-independent) "
                         "or their product (the sequence's importance ratio; needs a far wider band)")

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not (math.isfinite(self.cap) and self.cap >= 1):
            raise ValueError(f"cap must be a finite number >= 1 (a weight cap below 1 would shrink on-policy tokens), "
                             f"got {self.cap}")
        band = list(self.band)
        if len(band) != 2 or not all(math.isfinite(x) for x in band) or not 0 < band[0] <= 1 <= band[1]:
            raise ValueError(f"band must be [lo, hi] with 0 < lo <= 1 <= hi (an on-policy response, ratio 1, is kept), "
                             f"got {self.band}")

    @property
    def active(self) -> bool:
        return self.mode != "none"


def check_off_policy(cfg: OffPolicyConfig, policy_loss: str, old_logprobs: str) -> None:
    """Start-up checks across sections; ValueError naming the keys: every mode but none needs the proximal log-probs
    (`rollout.old_logprobs: recompute`; with `rollout` the old log-probs are the behaviour policy's and every weight
    would be 1), and decoupled the PPO surrogate."""
    if not cfg.active:
        return
    if old_logprobs != "recompute":
        raise ValueError(f"algo.off_policy.mode={cfg.mode} weighs by pi_prox / pi_behav, the recomputed old log-probs "
                         f"over the rollout's: it needs rollout.old_logprobs=recompute, got {old_logprobs!r}")
    allowed = MODE_POLICY_LOSSES.get(cfg.mode)
    if allowed is not None and policy_loss not in allowed:
        raise ValueError(f"algo.off_policy.mode={cfg.mode} is defined on the PPO clip: it needs algo.policy_loss="
                         f"{' or '.join(allowed)}, got {policy_loss!r} (tis, mis and seq_mask weigh any policy loss)")


class OffPolicyWeights(NamedTuple):
    """One step's correction (`off_policy_weights`).

    weight: [N, R] detached per-token weight of the policy-gradient term, 0 off the response tokens.
    mask: [N, R] the response tokens the actor's loss keeps (the response mask less the dropped tokens), dtype of
        the response mask: the loss's mask and the aggregation's denominator.
    sums: [6] fp64 (max ratio, sum of ratios, ratios counted, truncated tokens, masked tokens, response tokens),
        combinable over ranks (max of the first entry, sum of the rest: `megalign.rollout.mismatch.reduce_sums`).
    """

    weight: torch.Tensor
    mask: torch.Tensor
    sums: torch.Tensor


def off_policy_weights(proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                       cfg: OffPolicyConfig) -> OffPolicyWeights:
    """The weights, kept tokens and metric sums of mode `cfg.mode` (module doc) for one step.

    proximal_logp, behaviour_logp: [N, R] log-probs of the sampled response tokens under the proximal (recomputed)
    and behaviour (rollout) policies; mask: [N, R] response tokens (nonzero = valid). Computed in fp64 for fp64
    inputs, else fp32; the weight is returned in that dtype.
    """
    if not cfg.active:
        raise ValueError("off_policy_weights: mode 'none' has no weights (the trainers skip the correction)")
    if proximal_logp.shape != behaviour_logp.shape or mask.shape != proximal_logp.shape or proximal_logp.dim() != 2:
        raise ValueError(f"off_policy_weights: proximal_logp {tuple(proximal_logp.shape)}, behaviour_logp "
                         f"{tuple(behaviour_logp.shape)} and mask {tuple(mask.shape)} must be one [N, R] shape")
    acc = torch.float64 if proximal_logp.dtype == torch.float64 else torch.float32
    valid = mask != 0
    zero = torch.zeros((), dtype=acc, device=proximal_logp.device)
    log_w = torch.where(valid, proximal_logp.detach().to(acc) - behaviour_logp.detach().to(acc), zero)
    log_w = log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    w = torch.exp(log_w)
    truncated = dropped = torch.zeros_like(valid)
    if cfg.mode == "seq_mask":
        lengths = valid.sum(-1)
        log_s = log_w.sum(-1)
        if cfg.seq_ratio == "geometric":
            log_s = log_s / lengths.clamp(min=1)
        ratio = torch.exp(log_s.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        counted = lengths > 0
        drop = counted & ((ratio < cfg.band[0]) | (ratio > cfg.band[1]))
        keep = valid & ~drop[:, None]
        weight, dropped = keep.to(acc), valid & ~keep
    else:
        ratio, counted = w, valid
        over = valid & (w > cfg.cap)
        if cfg.mode == "tis":
            weight, keep, truncated = torch.where(valid, w.clamp(max=cfg.cap), zero), valid, over
        else:  # mis, decoupled: 0 above the cap; mis also takes the token out of the denominator
            weight, dropped = torch.where(valid & ~over, w, zero), over
            keep = valid & ~over if cfg.mode == "mis" else valid
    top = torch.where(counted, ratio, zero).amax() if ratio.numel() else zero
    sums = torch.stack([top.double(), torch.where(counted, ratio, zero).double().sum(), counted.double().sum(),
                        truncated.double().sum(), dropped.double().sum(), valid.double().sum()])
    return OffPolicyWeights(weight.detach(), keep.to(mask.dtype), sums)


def off_policy_metrics(sums: torch.Tensor) -> dict[str, float]:
    """The four `offpolicy/*` metrics (module doc) from `OffPolicyWeights.sums` combined over ranks; empty when the
    step had no response token."""
    top, total, counted, truncated, masked, tokens = sums.tolist()
    if tokens == 0:
        return {}
    return dict(zip(METRICS, (top, total / max(counted, 1.0), truncated / tokens, masked / tokens)))


def weighted_policy_loss(loss_fn: Callable, weight: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor,
                         advantages: torch.Tensor, mask: torch.Tensor, eps_low: Optional[float],
                         eps_high: Optional[float], dual_clip: Optional[float], beta: float = 0.0,
                         ref_logp: Optional[torch.Tensor] = None, kl_estimator: str = "k3"):
    """weight [b, R] x the policy loss `loss_fn` (a `megalign.algos.policy_losses` variant) per token, plus beta x
    the `kl_estimator` KL to `ref_logp`, unweighted (module doc): (loss [b, R], PolicyLossStats).

    The variant runs without its own KL term (beta 0; with `ref_logp` it still measures kl_mean, k3); the KL is
    added here, and kl_mean is then the estimator's mean. Shapes as the variant's; `weight` [b, R] detached.
    """
    if weight.shape != logp.shape:
        raise ValueError(f"weighted_policy_loss: weight {tuple(weight.shape)} must have logp's shape {tuple(logp.shape)}")
    loss, stats = loss_fn(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, 0.0, ref_logp)
    loss = loss * weight.detach().to(loss.dtype)
    if ref_logp is not None and beta:
        kl = kl_penalty(logp, ref_logp, kl_estimator) * mask
        loss = loss + beta * kl
        stats = stats._replace(kl_mean=kl.detach().float().sum() / stats.count.clamp(min=1))
    return loss, stats
