"""Pure-torch reference of token_logprob and its vocab-parallel building blocks (the merge of the shards'
statistics, which has no kernel, is `megalign.ops.token_logprob.combine_vocab_partials` itself).

Same math as the kernels (see megalign/ops/token_logprob.py), written to be as accurate as the
output dtype allows, because tests measure the kernels and this reference against a float64 oracle
and because this is also the path taken where the extension is not built:

- Every sum over the vocabulary is accumulated in float64, whatever the logits dtype: at V ~ 1.5e5
  an fp32 `log_softmax` is off by ~2e-5 in logp and ~1e-4 in the entropy, 10-60x the kernels.
- logp = (z_t - m) - log sum_j e^{z_j - m} relative to the row max m, never z_t - lse with a
  rounded lse, so the only error left is the final rounding to the output dtype.
- The float64 work runs over chunks of rows, so no [N, V] float64 temporary exists: a few
  [rows, V] ones with rows * V <= CHUNK_ELEMENTS (32 MiB each).
- token_logprob is an autograd.Function that saves the logits and the float64 per-row statistics
  and recomputes p in backward (chunked), as the kernels do, instead of letting autograd keep
  [N, V] intermediates. It is differentiable once (no double backward), like the kernels.

Statistics and logp / entropy are fp32 for fp32/bf16/fp16 logits and fp64 for fp64 logits;
gradients come back in the logits dtype.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

# Elements of one [rows, V] float64 chunk: 2^22 (32 MiB); rows = max(1, CHUNK_ELEMENTS // V).
CHUNK_ELEMENTS = 1 << 22


def _acc(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _row_chunks(n: int, v: int) -> list[slice]:
    """Row slices covering [0, n) with at most max(1, CHUNK_ELEMENTS // v) rows each."""
    rows = max(1, CHUNK_ELEMENTS // max(v, 1))
    return [slice(s, min(s + rows, n)) for s in range(0, n, rows)]


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


def _gather(z: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """z[r, local[r]] for local ids [rows] clamped into [0, Vs) (0 for an empty shard); rows whose id
    is outside need masking."""
    if z.shape[-1] == 0:
        return z.new_zeros(local.shape)
    return z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)


def _row_max(z: torch.Tensor) -> torch.Tensor:
    """max z over the vocabulary [rows]; -inf for an empty shard (Vs = 0, a tensor-parallel rank
    holding only padding), whose statistics are then the empty (-inf, 0, 0)."""
    return z.amax(-1) if z.shape[-1] else z.new_full(z.shape[:-1], float("-inf"))


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new float64 tensor z = logits / temperature (a [rows, V] chunk), free to be modified in place."""
    return logits.to(torch.float64, copy=True).div_(temperature)


def _sums(z: torch.Tensor, shift: torch.Tensor, with_entropy: bool):
    """(s, t) [rows] float64 of z [rows, Vs] float64 about shift [rows]: s = sum e^d, t = sum e^d d.

    z is overwritten with d = z - shift, clamped at the float64 minimum so a -inf logit gives
    e^d d = 0 * finite = 0, not 0 * -inf. t is None without with_entropy.
    """
    d = z.sub_(shift.unsqueeze(-1)).clamp_min_(torch.finfo(torch.float64).min)
    e = d.exp()
    s = e.sum(-1)
    return s, (e.mul_(d).sum(-1) if with_entropy else None)


def _shift(m: torch.Tensor) -> torch.Tensor:
    """The row max, or 0 for an all -inf row (whose statistics are then the empty (-inf, 0, 0))."""
    return m.masked_fill(m == float("-inf"), 0.0)


def _forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int,
             with_entropy: bool):
    """(logp, lse, entropy) [N] float64 of logits [N, V]; entropy None without with_entropy.

    Ignored rows give 0 for all three; an all -inf row gives NaN logp and entropy.
    """
    n, v = logits.shape
    logp = logits.new_empty(n, dtype=torch.float64)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    for rows in _row_chunks(n, v):
        z = _scaled(logits[rows], temperature)
        z_t = _gather(z, targets[rows])
        shift = _shift(_row_max(z))
        s, t = _sums(z, shift, with_entropy)
        log_s = s.log()
        lse[rows] = shift + log_s
        logp[rows] = (z_t - shift) - log_s
        if with_entropy:
            entropy[rows] = log_s - t / s
    ignored = targets == ignore_index
    return (logp.masked_fill_(ignored, 0.0), lse.masked_fill_(ignored, 0.0),
            None if entropy is None else entropy.masked_fill_(ignored, 0.0))


def _backward_into(out: torch.Tensor, logits_shard: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                   entropy: torch.Tensor | None, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None,
                   vocab_start: int, temperature: float, ignore_index: int) -> torch.Tensor:
    """Write dL/dlogits_shard [N, Vs] into out (any [N, Vs] tensor, possibly logits_shard itself).

    Each chunk of rows reads its logits before it writes its gradient, so out may alias the logits.
    The math is float64: p_j = e^{z_j - lse}; [g_logp (1[j=t] - p_j) - g_ent p_j (log p_j + H)] / T.
    """
    n, vs = logits_shard.shape
    if vs == 0:
        return out
    f64 = dict(dtype=torch.float64)
    lse, grad_logp = lse.to(**f64), grad_logp.to(**f64)
    if entropy is not None:
        entropy, grad_entropy = entropy.to(**f64), grad_entropy.to(**f64)
    local = targets - vocab_start
    in_shard = (local >= 0) & (local < vs) & (targets != ignore_index)
    ignored = targets == ignore_index
    for rows in _row_chunks(n, vs):
        logp_all = _scaled(logits_shard[rows], temperature).sub_(lse[rows].unsqueeze(-1))
        p = logp_all.exp()
        if entropy is not None:
            # p log p = 0 where p = 0 and log p = -inf (a -inf logit): no entropy gradient there.
            ent_term = logp_all.masked_fill_(logp_all == float("-inf"), 0.0).add_(entropy[rows].unsqueeze(-1))
            ent_term.mul_(p).mul_(grad_entropy[rows].unsqueeze(-1))
        gl = grad_logp[rows].unsqueeze(-1)
        grad = p.mul_(-gl)
        if entropy is not None:
            grad.sub_(ent_term)
        hit = in_shard[rows].unsqueeze(-1)
        grad.scatter_add_(-1, local[rows].clamp(0, vs - 1).unsqueeze(-1), gl * hit)
        grad.div_(temperature).masked_fill_(ignored[rows].unsqueeze(-1), 0.0)
        out[rows] = grad
    return out


class _TokenLogprob(torch.autograd.Function):
    """logits [N, V] -> (logp [N], entropy [N] or an empty tensor) in _acc(logits)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, ignore_index, with_entropy):
        logp, lse, entropy = _forward(logits, targets, temperature, ignore_index, with_entropy)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.args = (temperature, ignore_index)
        ctx.set_materialize_grads(False)
        acc = _acc(logits)
        ent = entropy.to(acc) if with_entropy else logp.new_empty(0, dtype=acc)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp.to(acc), ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature, ignore_index = ctx.args
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if entropy is None or grad_entropy is None:
            entropy = grad_entropy = None
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        _backward_into(out, logits, targets, lse, entropy, grad_logp, grad_entropy, 0, temperature, ignore_index)
        return out, None, None, None, None


def token_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  ignore_index: int = -100, return_entropy: bool = False):
    """log p(target) [...] (and entropy [...]) of logits [..., V] / temperature; ignored rows give 0."""
    _check_targets_in_range(targets, ignore_index, logits.shape[-1])
    vocab = logits.shape[-1]
    logp, entropy = _TokenLogprob.apply(logits.reshape(targets.numel(), vocab), targets.reshape(-1), float(temperature),
                                        int(ignore_index), bool(return_entropy))
    logp = logp.reshape(targets.shape)
    return (logp, entropy.reshape(targets.shape)) if return_entropy else logp


def token_logprob_partials(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                           temperature: float = 1.0, ignore_index: int = -100,
                           with_entropy: bool = False, vocab_size: int | None = None) -> torch.Tensor:
    """Per-row statistics [N, 4] = (m, sum e^{z-m}, z_target or 0, sum e^{z-m}(z-m)) of one shard.

    m is the row max rounded to the output dtype, and the sums are taken about that rounded m, so
    that m + log s is the shard's log-sum-exp to within the rounding of s alone.
    """
    _check_targets_in_range(targets, ignore_index, vocab_size)
    acc = _acc(logits_shard)
    n, vs = logits_shard.shape
    out = logits_shard.new_empty((n, 4), dtype=torch.float64)
    local = targets - vocab_start
    in_shard = (local >= 0) & (local < vs)
    for rows in _row_chunks(n, vs):
        z = _scaled(logits_shard[rows], temperature)
        z_t = torch.where(in_shard[rows], _gather(z, local[rows]), 0.0)
        m = _row_max(z).to(acc).to(torch.float64)
        s, t = _sums(z, _shift(m), with_entropy)
        out[rows] = torch.stack([m, s, z_t, t if with_entropy else torch.zeros_like(s)], dim=-1)
    ignored = (targets == ignore_index).unsqueeze(-1)
    return torch.where(ignored, out.new_tensor([0.0, 1.0, 0.0, 0.0]), out).to(acc)


def token_logprob_shard_backward(logits_shard, targets, lse, entropy, grad_logp, grad_entropy,
                                 vocab_start: int, temperature: float = 1.0, ignore_index: int = -100,
                                 inplace: bool = False) -> torch.Tensor:
    """dL/dlogits_shard [N, Vs] in the logits dtype (into logits_shard when inplace), from the global
    lse and entropy [N]: [g_logp (1[j=t] - p_j) - g_ent p_j (log p_j + H)] / temperature."""
    out = logits_shard if inplace else torch.empty(logits_shard.shape, dtype=logits_shard.dtype,
                                                   device=logits_shard.device)
    return _backward_into(out, logits_shard, targets, lse, entropy, grad_logp, grad_entropy, vocab_start,
                          temperature, ignore_index)
