"""Fused per-token PPO/GRPO policy loss with its statistics, in one pass over the tokens.

    policy_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=None, dual_clip=None,
                beta=0.0, ref_logp=None, reduction="none") -> (loss [*] or [], PolicyLossStats)

Per token (verl's `compute_policy_loss`; PPO, Schulman et al. 2017; clip-higher eps_high from
DAPO, Yu et al. 2025; dual clip from Ye et al. 2020, verl's clip_ratio_c; KL term as in GRPO,
Shao et al. 2024):

    log_ratio = clamp(logp - old_logp, -20, 20);  ratio = exp(log_ratio)
    surr1 = -A * ratio;  surr2 = -A * clamp(ratio, 1 - eps_low, 1 + eps_high)
    l = max(surr1, surr2);  if dual_clip c and A < 0: l = min(l, -A * c)
    loss = l + beta * k3(logp, ref_logp)            (k3 as in megalign.ops.kl_penalty)

`loss` is 0 at masked tokens (mask == 0); aggregate it as you like, e.g. verl's token-mean
`loss.sum() / stats.count.clamp(min=1)`, or let the op reduce it (`reduction`, as in torch's
losses): "sum" gives the 0-d sum over valid tokens (for a token-mean over a global count, as the
trainers' `aggregate_loss` divides it), "mean" that sum / stats.count.clamp(min=1) (verl's
token-mean over this call's tokens; 0 with no valid token). On the CPU kernels a reduced loss is
summed in the same pass and no per-token loss is stored (its [*] write and the separate sum are
what make verl's compute_policy_loss return a scalar cheaply); on CUDA the op sums its per-token
loss. The statistics (PolicyLossStats: count, clip_frac,
dual_clip_frac, approx_kl, ratio_min, ratio_max, kl_mean) are reduced in the same kernel pass
and returned as 0-d fp32 tensors without a host sync; an all-masked input gives count 0 and
finite defaults. kl_mean is computed whenever ref_logp is given, even with beta = 0.

Shapes and dtypes: logp, old_logp, advantages and ref_logp share one float dtype (fp32, fp64,
bf16, fp16) and one shape (any, usually [B, T]); mask has the same shape and is bool, uint8,
int32, int64 or float with nonzero = valid (0/1 semantics, not a weight). The loss is fp32 (fp64
for fp64 inputs). Inputs may be non-contiguous.

Gradient: w.r.t. logp only. old_logp, advantages and ref_logp are constants of the RL step
(sampled-policy log-probs, estimated advantages, frozen reference) and get None. On the CPU
kernels with fp32 / fp64 inputs and logp requiring a gradient, the forward pass also writes
d loss / d logp per token (`with_dlogp`, as in megalign.ops.kl_penalty), and the backward only
scales that buffer in place by the upstream gradient, which then is grad_logp: the backward reads
no input again and allocates nothing. Otherwise (CUDA, bf16 / fp16, or a second backward through
a retained graph) the backward recomputes every token from the saved inputs in one pass. Either
way (autograd in C++, as for megalign.ops.kl_penalty) no [B, T] intermediate is kept beyond the
loss and the buffer that becomes grad_logp. The statistics carry no gradient. An upstream
gradient that is inf / NaN at a masked token gives NaN there on the in-place path (0 * inf) and 0 on the recompute path.
"""
from __future__ import annotations

import torch

from megalign.ops import _backend
from megalign.ops.kl_penalty import check_operands, wants_dlogp
from megalign.ops.common import PolicyLossStats, acc_dtype
from megalign.ops.reference.policy_loss import policy_loss as reference_policy_loss

__all__ = ["policy_loss", "PolicyLossStats", "REDUCTIONS"]

REDUCTIONS = ("none", "sum", "mean")

_STATS = len(PolicyLossStats._fields)


def _check_coefficients(eps_low, eps_high, dual_clip, beta, ref_logp) -> None:
    if not eps_low >= 0:
        raise ValueError(f"policy_loss: eps_low must be >= 0, got {eps_low}")
    if not eps_high >= 0:
        raise ValueError(f"policy_loss: eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"policy_loss: dual_clip must be > 1 (verl's clip_ratio_c), got {dual_clip}")
    if not beta >= 0:
        raise ValueError(f"policy_loss: beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"policy_loss: beta = {beta} > 0 needs ref_logp, got None")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None,
                beta: float = 0.0, ref_logp: torch.Tensor | None = None, reduction: str = "none"
                ) -> tuple[torch.Tensor, PolicyLossStats]:
    """Clipped policy loss, per token [*] (0 at masked tokens) or reduced to [] (`reduction`), and its
    PolicyLossStats; see the module docstring."""
    eps_high = eps_low if eps_high is None else eps_high
    _check_coefficients(eps_low, eps_high, dual_clip, beta, ref_logp)
    if reduction not in REDUCTIONS:
        raise ValueError(f"policy_loss: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    check_operands("policy_loss", logp, mask=mask, old_logp=old_logp, advantages=advantages, ref_logp=ref_logp)
    if not _backend.use_kernels(logp):
        loss, stats = reference_policy_loss(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta,
                                            ref_logp)
        loss = loss if reduction == "none" else loss.sum()
    else:
        loss, stats, _ = torch.ops.megalign.policy_loss_fwd(
            logp, old_logp, advantages, mask, float(eps_low), float(eps_high),
            None if dual_clip is None else float(dual_clip), float(beta), ref_logp, wants_dlogp(logp),
            reduction != "none")
        stats = PolicyLossStats.from_tensor(stats)
    if reduction == "mean":
        loss = loss / stats.count.clamp(min=1).to(loss.dtype)
    return loss, stats


def _register() -> None:
    @torch.library.register_fake("megalign::policy_loss_fwd")
    def _(logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp, with_dlogp=False,
          sum_loss=False):
        return (logp.new_empty(() if sum_loss else logp.shape, dtype=acc_dtype(logp.dtype)),
                logp.new_empty((_STATS,), dtype=torch.float32),
                logp.new_empty(logp.shape if with_dlogp else (0,), dtype=acc_dtype(logp.dtype)))

    @torch.library.register_fake("megalign::policy_loss_bwd")
    def _(grad, logp, old_logp, advantages, mask, eps_low, eps_high, dual_clip, beta, ref_logp):
        return torch.empty_like(logp, memory_format=torch.contiguous_format)


if _backend.HAVE_EXTENSION:
    _register()
