"""Pairwise preference objectives as pure tensor functions: reward model, DPO family, TRL's DPO variants, WPO's
weights, SimPO, CPO, ORPO; and `PAIR_LOSSES`, the registry the DPO trainer picks `algo.loss` from (name -> the
loss, the `PreferenceAlgoConfig` coefficients it reads, whether it needs the reference), with that config.

Every loss scores pairs (chosen y_w, rejected y_l) of one prompt x. Conventions:

- Inputs are per-sequence *summed* log-probs [B] of the response tokens (prompt and padding
  excluded), plus the response token counts [B] (integers >= 1) where an average is needed;
  the reward model takes the scalar rewards [B]. Any float dtype; computed in fp32 (see `common`).
- Each loss returns `(losses, stats)`. `losses` [B] is the per-pair loss, unreduced: the trainer
  sums it over micro-batches and data-parallel ranks and divides by the global number of pairs, so
  the objective is the mean over the global batch whatever the split (as `aggregate_loss` does for
  GRPO). `stats` is a `PreferenceStats` of detached [B] tensors; `stats.metrics()` gives TRL's metric
  names ("rewards/chosen", ...) as `MetricSum`s to all-reduce and divide.
- NLL terms (RPO's `nll_coef`, CPO's alpha, ORPO's SFT term) are the chosen response's per-token
  negative log-likelihood of each pair, NLL_w = -log pi(y_w|x) / n_w (the summed log-prob over the
  chosen token count), summed over pairs by the trainer like the rest of the loss: the mean over
  pairs of each chosen response's token mean. TRL instead takes one cross-entropy over all chosen
  tokens of the batch (a token mean, so long responses weigh more); the two agree when the chosen
  responses have equal lengths.

With h = (log pi(y_w) - log pi(y_l)) - (log pi_ref(y_w) - log pi_ref(y_l)) the DPO family
(`DPO_LOSSES`, chosen by name) is:

    "sigmoid"  -log sigma(beta h)                              DPO, Rafailov et al. 2023 (arXiv 2305.18290);
               with label smoothing eps:                       conservative DPO (Mitchell 2023)
               (1 - eps)(-log sigma(beta h)) + eps(-log sigma(-beta h))
    "robust"   [(1 - eps)(-log sigma(beta h)) + eps log sigma(-beta h)] / (1 - 2 eps)
                                                               robust DPO, Chowdhury et al. 2024 (arXiv 2403.00409)
    "hinge"    relu(1 - beta h)                                SLiC-HF, Zhao et al. 2023 (arXiv 2305.10425)
    "ipo"      (h_avg - 1 / (2 beta))^2                        IPO, Azar et al. 2023 (arXiv 2310.12036), eq. 17;
               h_avg is h on token-averaged log-probs (log-prob sum / token count, policy and
               reference alike), as TRL's "ipo" computes it; beta is the paper's tau.

With the log-ratios r_w = log pi(y_w) - log pi_ref(y_w), r_l likewise (so h = r_w - r_l), the DPO
variants of TRL's DPOTrainer (`DPO_VARIANTS`, `dpo_variant_loss`; summed log-probs) are:

    "apo_zero"   sigma(-beta r_w) + sigma(beta r_l)             APO-zero, D'Oosterlinck et al. 2024 (arXiv 2408.06266) eq. 7
    "apo_down"   sigma(beta r_w) + sigma(-beta h)               APO-down, eq. 8
    "nca_pair"   -log sigma(beta r_w) - (log sigma(-beta r_w) + log sigma(-beta r_l)) / 2
                                                               NCA, Chen et al. 2024 (arXiv 2402.05369)
    "sppo_hard"  (r_w - 1 / (2 beta))^2 + (r_l + 1 / (2 beta))^2
                                                               SPPO with hard labels (P = 1 for y_w, 0 for y_l),
                                                               Wu et al. 2024 (arXiv 2405.00675) eq. 4.7
    "exo_pair"   sigma(beta h) (log sigma(beta h) - log(1 - eps)) + sigma(-beta h) (log sigma(-beta h) - log eps)
                                                               EXO, Ji et al. 2024 (arXiv 2402.00856) eq. 16: the
                                                               reverse KL to the label distribution (1 - eps, eps)
    "bco_pair"   -log sigma(beta r_w - delta) - log sigma(-(beta r_l - delta))
                                                               BCO, Jung et al. 2024 (arXiv 2404.04656), with the
                                                               reward shift delta (see `dpo_variant_loss`)

WPO (Zhou et al. 2024, arXiv 2406.11827) weights any of these per pair (`weights` of `dpo_loss` and
`dpo_variant_loss`, from `wpo_weights`): w = min(1, exp(a_w + a_l)), a = the response's token mean of
log p(y_t) - log sum_v p_v^2 (eq. 3, the probability-adjusted log-prob, from the LM head by
`wpo_token_logps`, vocab-parallel), treated as a constant as in TRL (`use_weighting`).

The implicit rewards of the stats are beta (log pi(y) - log pi_ref(y)) on the log-probs the loss
used (token averages for "ipo"), as TRL's DPOTrainer reports them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalign.algos.common import MetricSum, as_vectors, check_non_negative, check_positive, metric_sum
from megalign.config import option

# ORPO's odds p / (1 - p) are infinite at p = 1; the average log-prob is capped here inside the odds
# (p <= 1 - 1e-6, log odds <= 13.8), so the loss and its gradient stay finite when a response is
# certain to rounding. The SFT term uses the uncapped value.
ORPO_MAX_AVG_LOGP = -1e-6


class PreferenceStats(NamedTuple):
    """Per-pair statistics, detached [B] tensors in the compute dtype; None where a loss has no such term."""

    chosen_rewards: torch.Tensor
    """The reward of y_w: the reward model's score, or the implicit reward (see each loss)."""
    rejected_rewards: torch.Tensor
    chosen_logps: Optional[torch.Tensor] = None
    """Policy log-prob of y_w the loss used (summed, or token-averaged where the loss averages)."""
    rejected_logps: Optional[torch.Tensor] = None
    nll: Optional[torch.Tensor] = None
    """NLL_w = -log pi(y_w) / n_w, where the loss has an NLL term."""
    log_odds: Optional[torch.Tensor] = None
    """ORPO: log odds(y_w) - log odds(y_l)."""

    def metrics(self, where: Optional[torch.Tensor] = None) -> dict[str, MetricSum]:
        """TRL's DPOTrainer / ORPOTrainer metric names, each as a MetricSum over the pairs (those where the bool
        mask `where` [B] is True, when given: online DPO's tied pairs in a fixed-shape pipeline batch count not)."""
        out = {
            "rewards/chosen": metric_sum(self.chosen_rewards, where),
            "rewards/rejected": metric_sum(self.rejected_rewards, where),
            "rewards/accuracies": metric_sum((self.chosen_rewards > self.rejected_rewards).to(self.chosen_rewards.dtype),
                                             where),
            "rewards/margins": metric_sum(self.chosen_rewards - self.rejected_rewards, where),
        }
        if self.chosen_logps is not None:
            out["logps/chosen"] = metric_sum(self.chosen_logps, where)
        if self.rejected_logps is not None:
            out["logps/rejected"] = metric_sum(self.rejected_logps, where)
        if self.nll is not None:
            out["nll_loss"] = metric_sum(self.nll, where)
        if self.log_odds is not None:
            out["log_odds_ratio"] = metric_sum(F.logsigmoid(self.log_odds), where)
            out["log_odds_chosen"] = metric_sum(self.log_odds, where)
        return out


def reward_model_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, *,
                      margin: Optional[torch.Tensor] = None,
                      center_coef: float = 0.0) -> tuple[torch.Tensor, PreferenceStats]:
    """Bradley-Terry pairwise loss of a scalar reward model, per pair [B].

        -log sigma(r_c - r_r - m) + c (r_c + r_r)^2

    Args:
        chosen_rewards, rejected_rewards: [B] scalar scores r_c, r_r of the reward head.
        margin: optional [B] per-pair margin m from the preference rating (Llama 2, Touvron et al.
            2023, arXiv 2307.09288 section 3.2.2): a clearly better response must win by more.
        center_coef: c >= 0, the centring term of Eisenstein et al. 2023 (TRL's
            `center_rewards_coefficient`) that keeps the rewards near zero mean.

    Returns: (losses [B], stats with the rewards; accuracy counts r_c > r_r strictly).
    """
    check_non_negative("center_coef", center_coef)
    if margin is None:
        rc, rr = as_vectors(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
        diff = rc - rr
    else:
        rc, rr, m = as_vectors(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards, margin=margin)
        diff = rc - rr - m
    losses = -F.logsigmoid(diff)
    if center_coef:
        losses = losses + center_coef * (rc + rr) ** 2
    return losses, PreferenceStats(rc.detach(), rr.detach())


class DPOLoss(NamedTuple):
    """One loss of the DPO family (a `DPO_LOSSES` entry)."""

    loss: Callable[[torch.Tensor, float, float], torch.Tensor]
    """(h [B], beta, label_smoothing) -> losses [B]."""
    length_averaged: bool
    """h is taken on token-averaged log-probs (needs the token counts)."""
    label_smoothing: bool
    """The loss has a label-smoothing (noisy preference) form."""


def _sigmoid(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def _robust(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)


def _hinge(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return torch.relu(1 - beta * h)


def _ipo(h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (h - 1 / (2 * beta)) ** 2


DPO_LOSSES: dict[str, DPOLoss] = {
    "sigmoid": DPOLoss(_sigmoid, length_averaged=False, label_smoothing=True),
    "robust": DPOLoss(_robust, length_averaged=False, label_smoothing=True),
    "hinge": DPOLoss(_hinge, length_averaged=False, label_smoothing=False),
    "ipo": DPOLoss(_ipo, length_averaged=True, label_smoothing=False),
}


def _check_label_smoothing(label_smoothing: float) -> None:
    if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 0.5):
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")


def _lengths(name: str, lengths: Optional[torch.Tensor], like: torch.Tensor, why: str) -> torch.Tensor:
    """The token counts `lengths` [B] in the compute dtype, checked against `like` [B]; an error names `name`."""
    if lengths is None:
        raise ValueError(f"{name} (response token counts [B]) is required {why}")
    return as_vectors(**{"policy_chosen_logps": like, name: lengths})[1]


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, *,
             loss_type: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
             nll_coef: float = 0.0, chosen_lengths: Optional[torch.Tensor] = None,
             rejected_lengths: Optional[torch.Tensor] = None,
             weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, PreferenceStats]:
    """A DPO-family loss per pair [B] (see the module docstring for the formulas).

    Args:
        policy_chosen_logps, policy_rejected_logps: [B] summed log pi(y_w|x), log pi(y_l|x).
        ref_chosen_logps, ref_rejected_logps: [B] the same under the frozen reference (no grad needed).
        loss_type: a key of DPO_LOSSES.
        beta: > 0, the KL strength (IPO's tau).
        label_smoothing: eps in [0, 0.5), the assumed rate of flipped labels; "sigmoid" and "robust" only.
        nll_coef: >= 0; adds nll_coef * NLL_w, the chosen response's per-token NLL (RPO, Pang et al.
            2024, arXiv 2404.19733; Llama 3, arXiv 2407.21783 section 4.1.4). Needs chosen_lengths.
        chosen_lengths, rejected_lengths: [B] response token counts; required by "ipo" (both) and
            by nll_coef > 0 (chosen).
        weights: optional [B] per-pair weights multiplying the loss, NLL term included (WPO: `wpo_weights`;
            TRL's `use_weighting`); taken as constants (no gradient).

    Returns: (losses [B], stats: implicit rewards, the policy log-probs the loss used, NLL_w if nll_coef > 0).
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; one of {', '.join(DPO_LOSSES)}")
    kind = DPO_LOSSES[loss_type]
    check_positive("beta", beta)
    _check_label_smoothing(label_smoothing)
    if label_smoothing and not kind.label_smoothing:
        raise ValueError(f"label_smoothing={label_smoothing} is not defined for loss_type {loss_type!r}; "
                         f"only for {', '.join(k for k, v in DPO_LOSSES.items() if v.label_smoothing)}")
    check_non_negative("nll_coef", nll_coef)
    pw, pl, rw, rl = as_vectors(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                                ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    nll = None
    if nll_coef:
        nll = -pw / _lengths("chosen_lengths", chosen_lengths, pw, "when nll_coef > 0")
    if kind.length_averaged:
        nw = _lengths("chosen_lengths", chosen_lengths, pw, f"by loss_type {loss_type!r}")
        nl = _lengths("rejected_lengths", rejected_lengths, pw, f"by loss_type {loss_type!r}")
        pw, rw, pl, rl = pw / nw, rw / nw, pl / nl, rl / nl
    losses = kind.loss((pw - pl) - (rw - rl), beta, label_smoothing)
    if nll is not None:
        losses = losses + nll_coef * nll
    return _weighted(losses, weights), _implicit_reward_stats(beta, pw, pl, rw, rl, nll)


def _weighted(losses: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """losses [B] times the constant per-pair `weights` [B] (WPO), or unchanged when None."""
    if weights is None:
        return losses
    return losses * as_vectors(losses=losses, weights=weights)[1].detach()


def _implicit_reward_stats(beta: float, pw: torch.Tensor, pl: torch.Tensor, rw: torch.Tensor, rl: torch.Tensor,
                           nll: Optional[torch.Tensor] = None) -> PreferenceStats:
    """TRL's DPO statistics: rewards beta (log pi - log pi_ref), the policy log-probs, NLL_w (all [B], detached)."""
    return PreferenceStats(chosen_rewards=(beta * (pw - rw)).detach(), rejected_rewards=(beta * (pl - rl)).detach(),
                           chosen_logps=pw.detach(), rejected_logps=pl.detach(), nll=None if nll is None else nll.detach())


def _apo_zero(rw: torch.Tensor, rl: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return torch.sigmoid(-beta * rw) + torch.sigmoid(beta * rl)


def _apo_down(rw: torch.Tensor, rl: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return torch.sigmoid(beta * rw) + torch.sigmoid(-beta * (rw - rl))


def _nca_pair(rw: torch.Tensor, rl: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -F.logsigmoid(beta * rw) - 0.5 * (F.logsigmoid(-beta * rw) + F.logsigmoid(-beta * rl))


def _sppo_hard(rw: torch.Tensor, rl: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (rw - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2


def _exo_pair(rw: torch.Tensor, rl: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    x = beta * (rw - rl)
    return (torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-eps))
            + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(eps)))


def _bco_pair(rw: torch.Tensor, rl: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    delta = (beta * torch.cat([rw, rl])).mean().detach()
    return -F.logsigmoid(beta * rw - delta) - F.logsigmoid(delta - beta * rl)


DPO_VARIANTS: dict[str, Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]] = {
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "nca_pair": _nca_pair,
    "sppo_hard": _sppo_hard,
    "exo_pair": _exo_pair,
    "bco_pair": _bco_pair,
}
"""TRL's DPO variants (module doc): (r_w [B], r_l [B], beta, EXO's eps) -> losses [B]."""

EXO_EPSILON = 1e-3
"""EXO's default eps: TRL takes eps from `label_smoothing` and uses 1e-3 when that is 0 (its default)."""


def dpo_variant_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
                     ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, *, loss_type: str,
                     beta: float = 0.1, exo_epsilon: float = EXO_EPSILON,
                     weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, PreferenceStats]:
    """One of TRL's DPO variants per pair [B] (`DPO_VARIANTS`; the module docstring gives the formulas).

    Args:
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps: [B] summed log-probs,
            as `dpo_loss`.
        loss_type: a key of DPO_VARIANTS.
        beta: > 0 (TRL's default 0.1; SPPO's 1 / (2 beta) target is the paper's eta / 2 with eta = 1 / beta).
        exo_epsilon: EXO's eps in (0, 0.5), the label distribution's weight on y_l ("exo_pair" only).
        weights: optional [B] constant per-pair weights (WPO), as in `dpo_loss`.

    BCO's reward shift delta is the mean of the detached implicit rewards beta r_w and beta r_l of the pairs
    of this call (the trainer calls once per micro-batch), not TRL's running mean. TRL's `RunningMoments`
    is updated at every loss call (each micro-batch, evaluation batches included) with that call's mean
    reward averaged over the processes, and delta is the mean of all updates so far: it carries history,
    is the same on every rank, and is not saved in checkpoints. Here each micro-batch's delta is its own
    (TRL's delta at its first call, on one process), so the loss stays a pure function of its inputs and a
    resumed run needs no state; it depends on the micro-batch split, unlike the other losses.

    Returns: (losses [B], stats: implicit rewards beta r, the policy log-probs), as `dpo_loss`.
    """
    if loss_type not in DPO_VARIANTS:
        raise ValueError(f"unknown DPO variant loss_type {loss_type!r}; one of {', '.join(DPO_VARIANTS)}")
    check_positive("beta", beta)
    check_exo_epsilon(exo_epsilon)
    pw, pl, rw, rl = as_vectors(policy_chosen_logps=policy_chosen_logps, policy_rejected_logps=policy_rejected_logps,
                                ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    losses = DPO_VARIANTS[loss_type](pw - rw, pl - rl, beta, exo_epsilon)
    return _weighted(losses, weights), _implicit_reward_stats(beta, pw, pl, rw, rl)


def check_exo_epsilon(exo_epsilon: float) -> None:
    """Raise ValueError naming exo_epsilon unless it is in (0, 0.5): log eps and log(1 - eps) finite, y_w preferred."""
    if not (isinstance(exo_epsilon, (int, float)) and 0 < exo_epsilon < 0.5):
        raise ValueError(f"exo_epsilon must be in (0, 0.5), got {exo_epsilon!r}")


def wpo_weights(chosen_adjusted: torch.Tensor, rejected_adjusted: torch.Tensor, chosen_lengths: torch.Tensor,
                rejected_lengths: torch.Tensor) -> torch.Tensor:
    """WPO's per-pair weights [B] (Zhou et al. 2024, arXiv 2406.11827, eq. 2-3, as TRL's `use_weighting`), detached:

        w = min(1, exp(A_w / n_w + A_l / n_l)),   A = sum over the response's tokens of log p(y_t) - log sum_v p_v^2

    Args:
        chosen_adjusted, rejected_adjusted: [B] the sums A of the policy's probability-adjusted token log-probs
            (`wpo_token_logps`) over each response; chosen_lengths, rejected_lengths: [B] token counts n.
    """
    aw, al, nw, nl = as_vectors(chosen_adjusted=chosen_adjusted, rejected_adjusted=rejected_adjusted,
                                chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    return torch.exp(aw.detach() / nw + al.detach() / nl).clamp(max=1.0)


@torch.no_grad()
def wpo_token_logps(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor,
                    group: Optional[dist.ProcessGroup] = None, vocab_start: int = 0, vocab_size: Optional[int] = None,
                    chunk_size: int = 1024) -> torch.Tensor:
    """WPO's probability-adjusted token log-probs [N], log p(y_t) - log sum_v p_v^2 of p = softmax(hidden @ W^T)
    (Zhou et al. 2024, eq. 3), without the [N, V] logits and without gradient (TRL's weights are constants).

    With Z1 = logsumexp(z) and Z2 = logsumexp(2 z): log p(y) = z_y - Z1 and log sum_v p_v^2 = Z2 - 2 Z1, so the
    term is z_y + Z1 - Z2. Each rank reduces its vocabulary shard, chunk by chunk ([chunk_size, Vs] logits at a
    time, matmul in the weight's dtype, reductions in fp32), to (Z1, Z2, z_y) partials [N, 3] (z_y = -inf where
    y is not in the shard); at tp > 1 one all-gather of those and a logsumexp over the ranks merge all three.
    The fused head (`fused_linear_token_logprob`) keeps (max, sum e^(z - max), z_y, entropy term) and no sum of
    e^(2z), so this is one more forward-only pass over the head, taken only by WPO.

    Args:
        hidden: [N, H] final hidden states (replicated over `group`); targets: [N] global token ids.
        weight_shard: [Vs, H] this rank's LM-head rows, global ids [vocab_start, vocab_start + Vs).
        group: the tensor-parallel group (None: tp = 1).
        vocab_size: the real vocabulary (rows at ids >= vocab_size are padding, excluded); None: Vs * tp.

    Returns: [N] fp32 (fp64 for fp64 hidden states), the same on every rank of `group`.
    """
    if hidden.dim() != 2 or weight_shard.dim() != 2 or hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"wpo_token_logps: need hidden [N, H] and weight_shard [Vs, H], got hidden "
                         f"{tuple(hidden.shape)} and weight_shard {tuple(weight_shard.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"wpo_token_logps: targets must be [N] = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"wpo_token_logps: chunk_size must be >= 1, got {chunk_size}")
    tp = 1 if group is None else dist.get_world_size(group)
    if vocab_size is None:
        vocab_size = weight_shard.shape[0] * tp
    rows = weight_shard[:max(0, min(weight_shard.shape[0], vocab_size - vocab_start))]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    partials = hidden.new_full((hidden.shape[0], 3), float("-inf"), dtype=acc)
    local = targets - vocab_start
    mine = (local >= 0) & (local < rows.shape[0])
    for start in range(0, hidden.shape[0] if rows.shape[0] else 0, chunk_size):
        end = start + chunk_size
        z = (hidden[start:end].to(rows.dtype) @ rows.t()).to(acc)
        z_y = z.gather(1, local[start:end].clamp(0, rows.shape[0] - 1)[:, None]).squeeze(1)
        partials[start:end] = torch.stack([z.logsumexp(-1), (2 * z).logsumexp(-1),
                                           z_y.masked_fill(~mine[start:end], float("-inf"))], -1)
    if tp > 1:
        gathered = partials.new_empty((tp, *partials.shape))
        dist.all_gather(list(gathered.unbind(0)), partials, group=group)
        partials = gathered.logsumexp(0)
    return partials[:, 2] + partials[:, 0] - partials[:, 1]


def _averages(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
              rejected_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pw, pl, nw, nl = as_vectors(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                                chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    return pw / nw, pl / nl


def simpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
               rejected_lengths: torch.Tensor, *, beta: float = 2.0,
               gamma_beta_ratio: float = 0.5) -> tuple[torch.Tensor, PreferenceStats]:
    """SimPO (Meng et al. 2024, arXiv 2405.14734), no reference model, per pair [B]:

        -log sigma(beta (avg_w - avg_l) - gamma),   avg = log pi(y|x) / |y|,   gamma = beta * gamma_beta_ratio

    Args:
        chosen_logps, rejected_logps: [B] summed policy log-probs; chosen_lengths, rejected_lengths: [B] token counts.
        beta: > 0 (the paper's default 2.0); gamma_beta_ratio: >= 0, the target margin over beta
            (the paper's `gamma_beta_ratio`, default 0.5; TRL's `simpo_gamma` is gamma itself).

    Returns: (losses [B], stats: rewards beta * avg and the averages, as TRL's CPOTrainer reports for SimPO).
    """
    check_positive("beta", beta)
    check_non_negative("gamma_beta_ratio", gamma_beta_ratio)
    aw, al = _averages(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths)
    losses = -F.logsigmoid(beta * (aw - al) - beta * gamma_beta_ratio)
    return losses, PreferenceStats((beta * aw).detach(), (beta * al).detach(), aw.detach(), al.detach())


def cpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor, *,
             beta: float = 0.1, alpha: float = 1.0) -> tuple[torch.Tensor, PreferenceStats]:
    """CPO (Xu et al. 2024, arXiv 2401.08417), no reference model, per pair [B]:

        -log sigma(beta (log pi(y_w) - log pi(y_l))) + alpha NLL_w

    on summed log-probs (as TRL's CPOTrainer "sigmoid"), with NLL_w = -log pi(y_w) / n_w.

    Args:
        chosen_logps, rejected_logps: [B] summed policy log-probs; chosen_lengths: [B] chosen token counts.
        beta: > 0; alpha: >= 0, the weight of the NLL (behaviour cloning) term.

    Returns: (losses [B], stats: rewards beta * log pi(y), the log-probs, NLL_w).
    """
    check_positive("beta", beta)
    check_non_negative("alpha", alpha)
    pw, pl, nw = as_vectors(chosen_logps=chosen_logps, rejected_logps=rejected_logps, chosen_lengths=chosen_lengths)
    nll = -pw / nw
    losses = -F.logsigmoid(beta * (pw - pl)) + alpha * nll
    return losses, PreferenceStats((beta * pw).detach(), (beta * pl).detach(), pw.detach(), pl.detach(), nll.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012): log(-expm1(x)) near 0, log1p(-exp(x)) below -log 2."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _log_odds(avg_logp: torch.Tensor) -> torch.Tensor:
    x = avg_logp.clamp(max=ORPO_MAX_AVG_LOGP)
    return x - _log1mexp(x)


def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
              rejected_lengths: torch.Tensor, *, lam: float = 0.1) -> tuple[torch.Tensor, PreferenceStats]:
    """ORPO (Hong et al. 2024, arXiv 2403.07691), no reference model, per pair [B]:

        NLL_w - lam log sigma(log odds(y_w) - log odds(y_l)),   odds(y) = p / (1 - p),   p = exp(avg),

    on the token-averaged log-probs avg = log pi(y|x) / |y| (as TRL's ORPOTrainer), with
    log odds = avg - log(1 - exp(avg)) computed stably and avg capped at ORPO_MAX_AVG_LOGP inside
    the odds. NLL_w = -avg_w.

    Args:
        chosen_logps, rejected_logps: [B] summed policy log-probs; chosen_lengths, rejected_lengths: [B] token counts.
        lam: >= 0, the odds-ratio weight lambda (TRL's `beta`).

    Returns: (losses [B], stats: rewards lam * avg and the averages as TRL reports them, NLL_w, the log odds ratio).
    """
    check_non_negative("lam", lam)
    aw, al = _averages(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths)
    log_odds = _log_odds(aw) - _log_odds(al)
    losses = -aw - lam * F.logsigmoid(log_odds)
    return losses, PreferenceStats((lam * aw).detach(), (lam * al).detach(), aw.detach(), al.detach(),
                                   (-aw).detach(), log_odds.detach())


class PairLogps(NamedTuple):
    """What a pairwise loss reads of B pairs: summed log-probs [B] of the policy (and of the reference, None for
    the reference-free losses) and the response token counts [B]."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor
    ref_chosen: Optional[torch.Tensor] = None
    ref_rejected: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    """WPO's constant per-pair weights [B] (`wpo_weights`), given when `algo.use_weighting`."""


class PairLoss(NamedTuple):
    """One entry of `PAIR_LOSSES`, the pairwise losses the DPO trainers (offline and online) offer as `algo.loss`."""

    loss: Callable[["PreferenceAlgoConfig", PairLogps], tuple[torch.Tensor, PreferenceStats]]
    """(config, log-probs) -> (losses [B], stats)."""
    reads: tuple[str, ...]
    """The `PreferenceAlgoConfig` coefficients it reads."""
    reference: bool
    """Whether it compares with the frozen reference (reads `PairLogps.ref_*`)."""


def _dpo_entry(loss_type: str) -> PairLoss:
    def loss(a: "PreferenceAlgoConfig", x: PairLogps) -> tuple[torch.Tensor, PreferenceStats]:
        return dpo_loss(x.chosen, x.rejected, x.ref_chosen, x.ref_rejected, loss_type=loss_type, beta=a.beta_value,
                        label_smoothing=a.label_smoothing, nll_coef=a.nll_coef, chosen_lengths=x.chosen_lengths,
                        rejected_lengths=x.rejected_lengths, weights=x.weights)
    smoothing = ("label_smoothing",) if DPO_LOSSES[loss_type].label_smoothing else ()
    return PairLoss(loss, ("beta", *smoothing, "nll_coef", "use_weighting"), reference=True)


def _variant_entry(loss_type: str) -> PairLoss:
    def loss(a: "PreferenceAlgoConfig", x: PairLogps) -> tuple[torch.Tensor, PreferenceStats]:
        return dpo_variant_loss(x.chosen, x.rejected, x.ref_chosen, x.ref_rejected, loss_type=loss_type,
                                beta=a.beta_value, exo_epsilon=a.exo_epsilon, weights=x.weights)
    own = ("exo_epsilon",) if loss_type == "exo_pair" else ()
    return PairLoss(loss, ("beta", *own, "use_weighting"), reference=True)


PAIR_LOSSES: dict[str, PairLoss] = {
    **{name: _dpo_entry(name) for name in DPO_LOSSES},
    **{name: _variant_entry(name) for name in DPO_VARIANTS},
    "simpo": PairLoss(lambda a, x: simpo_loss(x.chosen, x.rejected, x.chosen_lengths, x.rejected_lengths,
                                              beta=a.beta_value, gamma_beta_ratio=a.gamma_beta_ratio),
                      ("beta", "gamma_beta_ratio"), reference=False),
    "cpo": PairLoss(lambda a, x: cpo_loss(x.chosen, x.rejected, x.chosen_lengths, beta=a.beta_value, alpha=a.alpha),
                    ("beta", "alpha"), reference=False),
    "orpo": PairLoss(lambda a, x: orpo_loss(x.chosen, x.rejected, x.chosen_lengths, x.rejected_lengths, lam=a.lam),
                     ("lam",), reference=False),
}

REFERENCE_FREE = tuple(name for name, entry in PAIR_LOSSES.items() if not entry.reference)
"""Pairwise losses without a reference model."""

_SWITCHES = ("label_smoothing", "nll_coef", "exo_epsilon", "use_weighting")
"""Coefficients whose non-default value a loss that does not read them refuses (the others, beta and the
reference-free losses' own, keep their defaults harmlessly where unread)."""


@dataclasses.dataclass
class PreferenceAlgoConfig:
    """The pairwise loss and its coefficients (defaults as in the papers and TRL)."""

    loss: str = option("sigmoid", doc=f"pairwise loss: {', '.join(PAIR_LOSSES)} (formulas and papers: "
                                      "megalign.algos.preference)")
    beta: Optional[float] = option(None, doc="beta (ipo, sppo_hard: the target 1 / (2 beta)); null: 2.0 for simpo, "
                                             "else 0.1")
    label_smoothing: float = option(0.0, doc="sigmoid / robust: assumed rate of flipped labels eps in [0, 0.5)")
    nll_coef: float = option(0.0, doc="DPO family: weight of the chosen response's per-token NLL (RPO)")
    gamma_beta_ratio: float = option(0.5, doc="simpo: target margin gamma / beta")
    alpha: float = option(1.0, doc="cpo: weight of the chosen response's NLL")
    lam: float = option(0.1, doc="orpo: weight of the odds-ratio term")
    exo_epsilon: float = option(EXO_EPSILON, doc="exo_pair: eps in (0, 0.5) of the label distribution (1 - eps, eps) "
                                                 "(TRL: label_smoothing, 1e-3 when 0)")
    use_weighting: bool = option(False, doc="DPO losses and variants: weight each pair by WPO's min(1, exp(a_w + a_l)), "
                                            "a = the policy's mean adjusted token log-prob (TRL's use_weighting; one "
                                            "more forward-only pass of the LM head)")

    def __post_init__(self):
        """Every coefficient checked here, at start-up, not in the first loss after the reference pass."""
        if self.loss not in PAIR_LOSSES:
            raise ValueError(f"loss must be one of {list(PAIR_LOSSES)}, got {self.loss!r}")
        if self.beta is not None:
            check_positive("beta", self.beta)
        for name in ("nll_coef", "gamma_beta_ratio", "alpha", "lam"):
            check_non_negative(name, getattr(self, name))
        _check_label_smoothing(self.label_smoothing)
        check_exo_epsilon(self.exo_epsilon)
        fields = {f.name: f for f in dataclasses.fields(self)}
        for name in _SWITCHES:
            value = getattr(self, name)
            if value == fields[name].default or name in PAIR_LOSSES[self.loss].reads:
                continue
            readers = [k for k, v in PAIR_LOSSES.items() if name in v.reads]
            if not PAIR_LOSSES[self.loss].reference and set(readers) <= set(DPO_LOSSES):
                raise ValueError(f"{name}={value} is read only by the DPO losses ({', '.join(DPO_LOSSES)}), "
                                 f"not by loss {self.loss!r}")
            raise ValueError(f"{name}={value} is not defined for loss {self.loss!r}; only for {', '.join(readers)}")

    @property
    def beta_value(self) -> float:
        return self.beta if self.beta is not None else (2.0 if self.loss == "simpo" else 0.1)

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares with the frozen reference (the registry reads this too)."""
        return PAIR_LOSSES[self.loss].reference


def pair_losses(algo: PreferenceAlgoConfig, logps: PairLogps) -> tuple[torch.Tensor, PreferenceStats]:
    """(per-pair losses [B], statistics) of `algo.loss` (a `PAIR_LOSSES` entry) on the pairs' log-probs."""
    if algo.use_weighting and logps.weights is None:
        raise ValueError("algo.use_weighting needs WPO's per-pair weights: PairLogps.weights (wpo_weights)")
    return PAIR_LOSSES[algo.loss].loss(algo, logps)
