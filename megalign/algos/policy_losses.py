"""Policy-loss variants of the online family as pure tensor functions, chosen by name (`POLICY_LOSSES`).

Every variant has one signature and returns what `megalign.ops.policy_loss` returns, so the
trainers' update loop (`megalign.trainers.online.OnlineTrainer.train_role`), loss aggregation and
metrics do not change with the choice:

    fn(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip=None, beta=0.0, ref_logp=None)
        -> (loss [B, T] fp32 (fp64 for fp64 inputs), 0 at masked tokens; PolicyLossStats)

with r_t = exp(clamp(log pi(a_t) - log pi_old(a_t), +-20)) the token ratio and A_t the advantage:

- "ppo": the clipped surrogate max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) with dual clip, the
  fused kernel `megalign.ops.policy_loss` (Schulman et al. 2017; clip-higher DAPO; dual clip Ye et al. 2020).
- "cispo" (MiniMax-M1, Chen et al. 2025, arXiv 2506.13585, eq. 4-5): clip the importance-sampling
  *weight*, not the update, and keep every token's gradient:

      loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * log pi(a_t)
      d loss_t / d log pi(a_t) = -w_t * A_t,   w_t = sg(clip(r_t, ...))

  The paper sets eps_low large ("no lower bound on the IS weight") and tunes only eps_high;
  `eps_low=None` here means no lower bound. Aggregated with "token-mean" it is the paper's
  1 / sum|o_i| normalisation. The loss *value* is -w A log pi (as verl's `compute_policy_loss_cispo`),
  not a surrogate; only its gradient means something. clip_frac counts tokens whose weight was clipped.
- "gspo" (Qwen, Zheng et al. 2025, arXiv 2507.18071, eq. 5-7 and the GSPO-token form eq. 13-14): one
  importance ratio per sequence, the geometric mean of its token ratios over the valid tokens,

      s_i   = exp(mean_{t valid} (log pi(a_t) - log pi_old(a_t)))       (log s_i clamped to +-20)
      s_i,t = sg(s_i) * pi(a_t) / sg(pi(a_t))                           (value s_i, gradient s_i d log pi)
      loss_t = max(-A_t s_i,t, -A_t clip(s_i,t, 1 - eps_low, 1 + eps_high))

  so d loss_t / d log pi(a_t) = -A_t s_i when the unclipped branch is taken and 0 when the whole
  sequence is clipped. With A_t = A_i (group advantages) and the "seq-mean-token-mean" aggregation
  this is exactly GSPO's sequence objective 1/G sum_i min(s_i A_i, clip(s_i) A_i), whose gradient is
  s_i A_i * mean_t d log pi; token-varying advantages (REINFORCE++, GAE) are GSPO-token. The
  trainers therefore require "seq-mean-token-mean" with gspo (as verl hard-codes it). The paper's
  clip range is tiny (eps_low 3e-4, eps_high 4e-4) because s_i is a per-token geometric mean.
  clip_frac counts the tokens of clipped sequences; ratio_min / ratio_max are over the s_i.

Both new variants add GRPO's beta * k3(logp, ref_logp) per token when beta > 0, as the fused op
does, and report approx_kl = mean(old_logp - logp) (clamped log-ratio), kl_mean = mean k3 and
dual_clip_frac = 0 (dual clip is a PPO-surrogate bound; they reject `dual_clip`).

No kernel: both are a handful of elementwise ops on [B, T] (plus one row sum for gspo), which is
O(B T) against the O(B T V) log-prob forward that produced `logp`; `benchmarks/bench_policy_losses.py`
measures them beside the fused ppo op.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megalign.ops.kl_penalty import check_operands, kl_penalty
from megalign.ops.policy_loss import PolicyLossStats, policy_loss
from megalign.ops.common import LOG_RATIO_BOUND, acc_dtype

PolicyLossFn = Callable[..., tuple[torch.Tensor, PolicyLossStats]]


def _check(name: str, logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp) -> None:
    if dual_clip is not None:
        raise ValueError(f"{name}: dual_clip applies to the ppo surrogate only, got dual_clip={dual_clip}")
    if eps_low is not None and not eps_low >= 0:
        raise ValueError(f"{name}: eps_low must be >= 0 or None, got {eps_low}")
    if not eps_high >= 0:
        raise ValueError(f"{name}: eps_high must be >= 0, got {eps_high}")
    if not beta >= 0:
        raise ValueError(f"{name}: beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"{name}: beta = {beta} > 0 needs ref_logp, got None")
    check_operands(name, logp, mask=mask, old_logp=old_logp, advantages=advantages, ref_logp=ref_logp)
    if logp.dim() != 2:
        raise ValueError(f"{name}: logp must be [batch, tokens], got shape {tuple(logp.shape)}")


def _finish(loss: torch.Tensor, lp: torch.Tensor, log_ratio: torch.Tensor, valid: torch.Tensor,
            clipped: torch.Tensor, ratios: torch.Tensor, ratio_valid: torch.Tensor, beta: float,
            ref_logp: Optional[torch.Tensor], out_dtype: torch.dtype) -> tuple[torch.Tensor, PolicyLossStats]:
    """Add beta * k3, zero the masked tokens and reduce the PolicyLossStats (0-d fp32, no host sync)."""
    kl = kl_penalty(lp, ref_logp.to(lp.dtype), "k3") if ref_logp is not None else None
    if beta > 0:
        loss = loss + beta * kl
    loss = torch.where(valid, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    count = valid.sum().float()
    n = count.clamp(min=1)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.detach().float(), 0.0).sum() / n

    r = ratios.detach().float()
    any_valid = ratio_valid.any()
    ratio_min = torch.where(ratio_valid, r, float("inf")).amin() if r.numel() else r.new_ones(())
    ratio_max = torch.where(ratio_valid, r, -float("inf")).amax() if r.numel() else r.new_ones(())
    zero = torch.zeros((), device=loss.device)
    stats = PolicyLossStats(count=count, clip_frac=mean(clipped), dual_clip_frac=zero, approx_kl=mean(-log_ratio),
                            ratio_min=torch.where(any_valid, ratio_min, 1.0),
                            ratio_max=torch.where(any_valid, ratio_max, 1.0),
                            kl_mean=mean(kl) if kl is not None else zero)
    return loss.to(out_dtype), stats


def _compute(logp: torch.Tensor) -> torch.dtype:
    return torch.float64 if logp.dtype == torch.float64 else torch.float32


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               eps_low: Optional[float] = None, eps_high: float = 0.28, dual_clip: Optional[float] = None,
               beta: float = 0.0, ref_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, PolicyLossStats]:
    """CISPO per-token loss [B, T] and its stats (module doc); eps_low=None: no lower bound on the weight.

    Shapes and dtypes as `megalign.ops.policy_loss`: logp, old_logp, advantages (and ref_logp) [B, T]
    of one float dtype, mask [B, T] nonzero = valid. Gradient w.r.t. logp only.
    """
    _check("cispo_loss", logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp)
    acc = _compute(logp)
    lp, old, adv = logp.to(acc), old_logp.detach().to(acc), advantages.detach().to(acc)
    valid = mask != 0
    log_ratio = (lp.detach() - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(min=None if eps_low is None else 1.0 - eps_low, max=1.0 + eps_high)
    loss = -weight * adv * lp
    return _finish(loss, lp, log_ratio, valid, weight != ratio, ratio, valid, beta, ref_logp, acc_dtype(logp.dtype))


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_low: Optional[float] = 3e-4, eps_high: float = 4e-4, dual_clip: Optional[float] = None,
              beta: float = 0.0, ref_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, PolicyLossStats]:
    """GSPO-token per-token loss [B, T] and its stats (module doc): sequence ratio s_i, token gradients.

    Shapes as `cispo_loss`; rows are whole responses (s_i is taken over each row's valid tokens, so a
    micro-batch must never split a response). Aggregate with "seq-mean-token-mean" for GSPO proper.
    """
    if eps_low is None:
        raise ValueError("gspo_loss: eps_low must be a number (the paper's 3e-4), got None")
    _check("gspo_loss", logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp)
    acc = _compute(logp)
    lp, old, adv = logp.to(acc), old_logp.detach().to(acc), advantages.detach().to(acc)
    valid = mask != 0
    weights = valid.to(acc)
    token_log_ratio = (lp.detach() - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    lengths = weights.sum(-1)
    log_s = ((lp.detach() - old) * weights).sum(-1) / lengths.clamp(min=1)
    log_s = log_s.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(lp - lp.detach() + log_s[:, None])  # value s_i, gradient s_i * d log pi(a_t)
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(surr1, surr2)
    return _finish(loss, lp, token_log_ratio, valid, surr2.detach() > surr1.detach(), torch.exp(log_s), lengths > 0,
                   beta, ref_logp, acc_dtype(logp.dtype))


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             eps_low: Optional[float] = 0.2, eps_high: Optional[float] = None, dual_clip: Optional[float] = None,
             beta: float = 0.0, ref_logp: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, PolicyLossStats]:
    """The clipped PPO surrogate: the fused `megalign.ops.policy_loss` (eps_high None: eps_low)."""
    if eps_low is None:
        raise ValueError("ppo_loss: eps_low must be a number, got None")
    return policy_loss(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp)


POLICY_LOSSES: dict[str, PolicyLossFn] = {"ppo": ppo_loss, "cispo": cispo_loss, "gspo": gspo_loss}
"""Policy-loss variants by name (module doc), the values of the trainers' `algo.policy_loss`."""


def select_policy_loss(name: str) -> PolicyLossFn:
    """POLICY_LOSSES[name], or a ValueError naming the bad value and the choices."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
