"""Pure-torch reference of token_logprob and its vocab-parallel building blocks.

Same math as the kernels (see megalign/ops/token_logprob.py) written the obvious way, with
`log_softmax` over a materialised [N, V] tensor. Statistics are fp32 (fp64 for fp64 logits).
"""
from __future__ import annotations

import torch


def _acc(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check_targets_in_range(targets: torch.Tensor, ignore_index: int, vocab_size: int | None) -> None:
    bad = (targets != ignore_index) & (targets < 0)
    if vocab_size is not None:
        bad |= (targets != ignore_index) & (targets >= vocab_size)
    if bool(bad.any()):
        row = int(bad.reshape(-1).nonzero()[0, 0])
        value = int(targets.reshape(-1)[row])
        bound = f"0 <= target < {vocab_size}" if vocab_size is not None else "target >= 0"
        raise IndexError(f"token_logprob: targets (flat row {row}) = {value} is out of range: expected "
                         f"{bound} or ignore_index = {ignore_index}")


def token_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  ignore_index: int = -100, return_entropy: bool = False):
    """log p(target) [...] (and entropy [...]) of logits [..., V] / temperature; ignored rows give 0."""
    _check_targets_in_range(targets, ignore_index, logits.shape[-1])
    logp_all = torch.log_softmax(logits.to(_acc(logits)) / temperature, dim=-1)
    ignored = targets == ignore_index
    logp = logp_all.gather(-1, targets.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    logp = logp.masked_fill(ignored, 0.0)
    if not return_entropy:
        return logp
    # p log p = 0 where p = 0 and log p = -inf (a -inf logit); masked_fill also zeroes its gradient.
    finite_logp = logp_all.masked_fill(logp_all == float("-inf"), 0.0)
    entropy = -(logp_all.exp() * finite_logp).sum(-1)
    return logp, entropy.masked_fill(ignored, 0.0)


def token_logprob_partials(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                           temperature: float = 1.0, ignore_index: int = -100,
                           with_entropy: bool = False, vocab_size: int | None = None) -> torch.Tensor:
    """Per-row statistics [N, 4] = (m, sum e^{z-m}, z_target or 0, sum e^{z-m}(z-m)) of one shard."""
    _check_targets_in_range(targets, ignore_index, vocab_size)
    z = logits_shard.to(_acc(logits_shard)) / temperature
    m = z.amax(-1)
    # An all -inf shard is the empty statistic (-inf, 0, 0): shift it by 0 instead of by -inf.
    shift = m.masked_fill(m == float("-inf"), 0.0)
    d = (z - shift.unsqueeze(-1)).clamp_min(torch.finfo(z.dtype).min)
    e = d.exp()
    s = e.sum(-1)
    t = (e * d).sum(-1) if with_entropy else torch.zeros_like(s)
    local = targets - vocab_start
    in_shard = (local >= 0) & (local < z.shape[-1])
    z_t = z.gather(-1, local.clamp(0, max(z.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
    z_t = torch.where(in_shard, z_t, torch.zeros_like(z_t))
    out = torch.stack([m, s, z_t, t], dim=-1)
    ignored = (targets == ignore_index).unsqueeze(-1)
    return torch.where(ignored, out.new_tensor([0.0, 1.0, 0.0, 0.0]), out)


def combine_vocab_partials(partials: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    """Merge per-shard statistics [S, N, 4] into (logp [N], lse [N], entropy [N]).

    M = max_i m_i;  s = sum_i e^{m_i - M} s_i;  t = sum_i e^{m_i - M} (t_i + s_i (m_i - M));
    lse = M + log s;  logp = z_target - lse;  H = log s - t / s. Ignored rows give 0 for all three.
    The entropy is meaningful only when the partials were computed with_entropy. O(S * N).
    """
    m_i, s_i, z_i, t_i = partials.unbind(-1)
    m = m_i.amax(0)
    d = m_i - m.masked_fill(m == float("-inf"), 0.0)
    a = d.exp()
    nonempty = s_i > 0  # an all -inf shard has m_i = -inf and contributes nothing (not 0 * -inf)
    s = torch.where(nonempty, a * s_i, torch.zeros_like(s_i)).sum(0)
    t = torch.where(nonempty, a * (t_i + s_i * d), torch.zeros_like(t_i)).sum(0)
    log_s = s.log()
    lse = m + log_s
    logp = (z_i.sum(0) - m) - log_s  # exact for large logits, where lse is rounded
    entropy = log_s - t / s
    ignored = targets == ignore_index
    return logp.masked_fill(ignored, 0.0), lse.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0)


def token_logprob_shard_backward(logits_shard, targets, lse, entropy, grad_logp, grad_entropy,
                                 vocab_start: int, temperature: float = 1.0, ignore_index: int = -100,
                                 inplace: bool = False) -> torch.Tensor:
    """dL/dlogits_shard = [g_logp (1[j=t] - p_j) - g_ent p_j (log p_j + H)] / temperature."""
    z = logits_shard.to(_acc(logits_shard)) / temperature
    logp_all = z - lse.unsqueeze(-1)
    p = logp_all.exp()
    grad = -grad_logp.unsqueeze(-1) * p
    local = targets - vocab_start
    in_shard = (local >= 0) & (local < z.shape[-1]) & (targets != ignore_index)
    onehot = torch.zeros_like(grad).scatter_(
        -1, local.clamp(0, max(z.shape[-1] - 1, 0)).unsqueeze(-1), 1.0) * in_shard.unsqueeze(-1)
    grad = grad + onehot * grad_logp.unsqueeze(-1)
    if entropy is not None:
        finite_logp = logp_all.masked_fill(logp_all == float("-inf"), 0.0)
        grad = grad - grad_entropy.unsqueeze(-1) * p * (finite_logp + entropy.unsqueeze(-1))
    grad = (grad / temperature).masked_fill((targets == ignore_index).unsqueeze(-1), 0.0)
    grad = grad.to(logits_shard.dtype)
    if inplace:
        return logits_shard.copy_(grad)
    return grad
