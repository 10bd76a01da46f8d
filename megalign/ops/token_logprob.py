"""Per-token log-probabilities (and entropy) over a large vocabulary without an [N, V] temporary.

    z = logits / temperature,   lse = log sum_j e^{z_j},
    logp = z_target - lse,      H = -sum_j p_j log p_j = log s - t / s,

where, with m = max z, s = sum e^{z-m} and t = sum e^{z-m} (z-m) are accumulated in one pass
over the vocabulary with the online-softmax merge (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"), extended to t so the entropy stays stable for logits of any size.
Only the per-row lse (and H) are saved; the backward recomputes p_j = e^{z_j - lse}:

    dL/dlogits_j = [g_logp (1[j = target] - p_j) - g_H p_j (log p_j + H)] / temperature.

Design choices:
- Rows whose target equals ignore_index give logp = 0 and entropy = 0 and a zero gradient row;
  the kernels skip their logits entirely (prompt tokens cost nothing).
- Outputs are fp32 whatever the logits dtype (fp64 for fp64 logits, which keeps gradcheck exact);
  gradients come back in the logits dtype.
- `inplace_backward=True` writes the gradient into the logits buffer itself (as Liger-Kernel does),
  saving an [N, V] allocation: the logits are overwritten during backward and must not be used
  afterwards (another autograd node that saved them fails its version check). Logits whose leading
  dims cannot be flattened without a copy are copied first, and the copy is overwritten instead.
- Any row stride is used as is; a copy is made only when the vocabulary dim is not unit-stride.
- An out-of-range target id raises an IndexError naming `targets` and the flat row on the CPU;
  the CUDA kernels never read out of bounds and give NaN for such rows (no host sync).
- A row whose logits are all -inf gives NaN, like torch.log_softmax.
- logp and entropy are computed relative to the row max, exact for logits of any size; the
  saved lse is fp32, so for |logits / temperature| ~ 1e4 the backward's p_j carries the relative
  error of lse's rounding (~5e-4 there, ~1e-6 at typical LLM logit sizes).

Vocab-parallel building blocks (Megatron-style vocab-parallel cross entropy, with one collective):
each tensor-parallel rank computes `token_logprob_partials` of its shard, the ranks all-gather
the [N, 4] partials, every rank calls `combine_vocab_partials`, and the backward of each shard is
`token_logprob_shard_backward` with the global lse (and entropy). The unsharded op is the
one-shard case of the same kernels.
"""
from __future__ import annotations

import torch

from megalign.ops import _backend
from megalign.ops._backend import FLOAT_DTYPES
from megalign.ops.reference.token_logprob import token_logprob as _ref_token_logprob
from megalign.ops.reference.token_logprob import token_logprob_partials as _ref_partials
from megalign.ops.reference.token_logprob import token_logprob_shard_backward as _ref_shard_backward

__all__ = ["token_logprob", "token_logprob_partials", "combine_vocab_partials",
           "token_logprob_shard_backward"]



def _acc(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check(op: str, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: logits must be a float32/float64/bfloat16/float16 tensor, got "
                        f"{getattr(logits, 'dtype', type(logits))}")
    if logits.dim() < 1:
        raise ValueError(f"{op}: logits must have a vocabulary dimension, got shape {tuple(logits.shape)}")
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
        raise TypeError(f"{op}: targets must be an int64 tensor, got {getattr(targets, 'dtype', type(targets))}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"{op}: targets must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"{op}: targets is on {targets.device} but logits is on {logits.device}")
    if not (temperature > 0 and temperature != float("inf")):
        raise ValueError(f"{op}: temperature must be finite and > 0, got {temperature}")


def token_logprob(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  ignore_index: int = -100, return_entropy: bool = False,
                  inplace_backward: bool = False):
    """log p(targets | logits / temperature), and the entropy of that distribution.

    Args:
        logits: [..., V] float32/bfloat16/float16 (float64 on CPU).
        targets: [...] int64 ids in [0, V), or ignore_index.
        temperature: divides the logits (sampling temperature), > 0.
        ignore_index: target id whose row gives 0 (logp and entropy) and no gradient.
        return_entropy: also return the entropy [...] (differentiable).
        inplace_backward: the backward overwrites `logits` with their gradient (module docstring).

    Returns:
        logp [...] fp32 (fp64 for fp64 logits), or (logp, entropy) when return_entropy.
    """
    _check("token_logprob", logits, targets, temperature)
    if not _backend.use_kernels(logits):
        return _ref_token_logprob(logits, targets, temperature, ignore_index, return_entropy)
    vocab = logits.shape[-1]
    logp, _, entropy = torch.ops.megalign.token_logprob_fwd(
        logits.reshape(-1, vocab), targets.reshape(-1), float(temperature), int(ignore_index),
        bool(return_entropy), bool(inplace_backward))
    logp = logp.reshape(targets.shape)
    return (logp, entropy.reshape(targets.shape)) if return_entropy else logp


def token_logprob_partials(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                           temperature: float = 1.0, ignore_index: int = -100,
                           with_entropy: bool = False, vocab_size: int | None = None) -> torch.Tensor:
    """Softmax statistics of one vocab shard, to be all-gathered and merged by combine_vocab_partials.

    Args:
        logits_shard: [N, Vs], the logits of ids [vocab_start, vocab_start + Vs).
        targets: [N] int64 global ids (or ignore_index).
        vocab_size: the full vocabulary, when known, to reject targets >= vocab_size; negative
            targets are always rejected.

    Returns:
        [N, 4] fp32 (fp64 for fp64 logits): (m = max z, sum e^{z-m}, z_target if the target lies
        in this shard else 0, sum e^{z-m} (z-m) or 0 without with_entropy). Ignored rows give
        (0, 1, 0, 0). Not differentiable: the backward is token_logprob_shard_backward.
    """
    _check("token_logprob_partials", logits_shard, targets, temperature)
    if logits_shard.dim() != 2:
        raise ValueError(f"token_logprob_partials: logits_shard must be [N, Vs], got {tuple(logits_shard.shape)}")
    if not _backend.use_kernels(logits_shard):
        return _ref_partials(logits_shard, targets, vocab_start, temperature,
                                           ignore_index, with_entropy, vocab_size)
    return torch.ops.megalign.token_logprob_partials(
        logits_shard, targets, int(vocab_start), -1 if vocab_size is None else int(vocab_size),
        float(temperature), int(ignore_index), bool(with_entropy))


def combine_vocab_partials(partials: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    """Merge per-shard statistics [S, N, 4] into (logp [N], lse [N], entropy [N]) in partials.dtype.

    M = max_i m_i;  s = sum_i e^{m_i - M} s_i;  t = sum_i e^{m_i - M} (t_i + s_i (m_i - M));
    lse = M + log s;  logp = z_target - lse;  H = log s - t / s. Ignored rows give 0 for all three.
    The entropy is meaningful only when the partials were computed with_entropy. O(S * N), in
    float64 so the merge adds no rounding beyond the final one.
    """
    m_i, s_i, z_i, t_i = partials.to(torch.float64).unbind(-1)
    m = m_i.amax(0)
    d = m_i - m.masked_fill(m == float("-inf"), 0.0)  # an all -inf row: every shard empty, no inf - inf
    a = d.exp()
    nonempty = s_i > 0  # an all -inf shard has m_i = -inf and contributes nothing (not 0 * -inf)
    s = torch.where(nonempty, a * s_i, 0.0).sum(0)
    t = torch.where(nonempty, a * (t_i + s_i * d), 0.0).sum(0)
    log_s = s.log()
    lse = m + log_s
    logp = (z_i.sum(0) - m) - log_s  # exact for large logits, where lse is rounded
    entropy = log_s - t / s
    ignored = targets == ignore_index
    return tuple(x.masked_fill(ignored, 0.0).to(partials.dtype) for x in (logp, lse, entropy))


def token_logprob_shard_backward(logits_shard, targets, lse, entropy, grad_logp, grad_entropy,
                                 vocab_start: int, temperature: float = 1.0, ignore_index: int = -100,
                                 inplace: bool = False) -> torch.Tensor:
    """Gradient of a loss on (logp, entropy) w.r.t. one vocab shard of the logits.

    Args:
        logits_shard: [N, Vs]; targets [N] global ids; lse, entropy [N] the global statistics
            from combine_vocab_partials (entropy None when no entropy gradient flows);
        grad_logp, grad_entropy: [N] upstream gradients (grad_entropy None iff entropy is None).
        inplace: write the gradient into logits_shard and return it.

    Returns:
        [N, Vs] in the logits dtype: [g_logp (1[j = t] - p_j) - g_H p_j (log p_j + H)] / temperature,
        zero rows for ignored targets.
    """
    _check("token_logprob_shard_backward", logits_shard, targets, temperature)
    if (entropy is None) != (grad_entropy is None):
        raise ValueError("token_logprob_shard_backward: entropy and grad_entropy must be given together")
    if not _backend.use_kernels(logits_shard):
        return _ref_shard_backward(logits_shard, targets, lse, entropy, grad_logp,
                                                 grad_entropy, vocab_start, temperature,
                                                 ignore_index, inplace)
    args = (targets, lse, entropy, grad_logp, grad_entropy, int(vocab_start), float(temperature),
            int(ignore_index))
    if inplace:
        torch.ops.megalign.token_logprob_bwd_(logits_shard, *args)
        return logits_shard
    return torch.ops.megalign.token_logprob_bwd(logits_shard, *args)


if _backend.HAVE_EXTENSION:

    @torch.library.register_fake("megalign::token_logprob_partials")
    def _partials_fake(logits, targets, vocab_start, vocab_size, temperature, ignore_index, with_entropy):
        return logits.new_empty((logits.shape[0], 4), dtype=_acc(logits))

    @torch.library.register_fake("megalign::token_logprob_fwd")
    def _fwd_fake(logits, targets, temperature, ignore_index, with_entropy, inplace_backward):
        n = logits.shape[0]
        acc = _acc(logits)
        return (logits.new_empty((n,), dtype=acc), logits.new_empty((n,), dtype=acc),
                logits.new_empty((n if with_entropy else 0,), dtype=acc))

    @torch.library.register_fake("megalign::token_logprob_bwd")
    def _bwd_fake(logits, targets, lse, entropy, grad_logp, grad_entropy, vocab_start, temperature,
                  ignore_index):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    @torch.library.register_fake("megalign::token_logprob_bwd_")
    def _bwd_inplace_fake(logits, targets, lse, entropy, grad_logp, grad_entropy, vocab_start,
                          temperature, ignore_index):
        return None

    def _fwd_setup_context(ctx, inputs, output):
        logits, targets, temperature, ignore_index, with_entropy, inplace_backward = inputs
        _, lse, entropy = output
        ctx.save_for_backward(logits, targets, lse, entropy if with_entropy else None)
        ctx.temperature, ctx.ignore_index, ctx.inplace = temperature, ignore_index, inplace_backward
        ctx.mark_non_differentiable(lse)

    def _fwd_backward(ctx, grad_logp, grad_lse, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if entropy is None or grad_entropy is None:
            entropy = grad_entropy = None
        else:
            grad_entropy = grad_entropy.contiguous()
        grad = token_logprob_shard_backward(logits, targets, lse, entropy, grad_logp.contiguous(),
                                            grad_entropy, 0, ctx.temperature, ctx.ignore_index,
                                            inplace=ctx.inplace)
        return grad, None, None, None, None, None

    torch.library.register_autograd("megalign::token_logprob_fwd", _fwd_backward,
                                    setup_context=_fwd_setup_context)
