"""Per-token log-probs (and entropy) with the vocabulary sharded across the tensor-parallel group.

Two entry points, both built on the `megalign.ops.token_logprob` shard kernels:

`vocab_parallel_token_logprob(logits_shard, targets, group, vocab_start)`: the logits stay split
over the vocabulary (the output of an LM head that is a `ColumnParallelLinear` without
`gather_output`). This is Megatron-core's vocab-parallel cross entropy
(`tensor_parallel/cross_entropy.py`), which all-reduces the row max, then the target logit, then the
sum of exponentials (three collectives); here each rank reduces its shard to per-row statistics
(m, sum e^{z-m}, z_target, sum e^{z-m}(z-m)) with `token_logprob_partials`, ONE all-gather of those
[N, 4] partials follows, and every rank merges them with `combine_vocab_partials` into the same
logp, lse and entropy. Gathering the partials rather than all-reducing each term is what lets one
collective carry the max, the sum and the entropy term together (they merge by the online-softmax
rule, not by a plain sum).

`fused_linear_token_logprob(hidden, weight_shard, targets, ...)`: goes from the final hidden
states to log-probs in chunks of tokens, `hidden[chunk] @ W_shard^T -> partials`, so neither the
[N, V] logits nor their gradient ever exist; the backward recomputes each chunk's logits and
turns them into their gradient in place. This is Liger-Kernel's fused linear cross entropy
(Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training": peak memory 27.6 GB ->
5.8 GB at V=128k) made vocab-parallel: the chunk partials of all chunks are gathered in one
all-gather at the end of the forward. Memory beyond inputs and outputs: one [chunk, V / tp] logits
chunk in the hidden dtype; for bf16/fp16 weights also an fp32 [V / tp, H] gradient accumulator,
into which the GEMM writes directly on CUDA (an fp32-output addmm) and which elsewhere adds one
[V / tp, H] product per chunk (see `fused_linear_token_logprob`).

Conventions shared by both:
- `group=None` or a one-rank group means no tensor parallelism: no collective is issued and
  `torch.distributed` need not be initialised. (Unlike `megalign.parallel.collectives`, where None
  is the default group: pass `layout.tp_group` explicitly.)
- Megatron pads the vocabulary to a multiple of tp (`pad_vocab_size`); with `vocab_size` given,
  the columns of this shard at global ids >= vocab_size are padding. They are excluded by slicing
  the shard to its valid columns (a strided view, no copy), so they receive no probability, never
  change logp or the entropy, and get an exactly zero gradient, whatever values they hold.
  Without `vocab_size` every column is a real id and the vocabulary is Vs * tp (equal shards).
  Target ids >= the vocabulary raise an IndexError on the CPU (NaN rows on CUDA, see token_logprob).
- Outputs are fp32 (fp64 for fp64 inputs) and identical on every rank of the group; rows whose
  target is `ignore_index` give 0 and no gradient.
- The backward needs no collective for the logits: logp and the entropy are replicated across the
  group, so the loss computed from them and its upstream gradient are the same on every rank, and
  d logp / d logits_shard needs only the global lse and entropy, which every rank already holds.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalign.ops.token_logprob import (combine_vocab_partials, token_logprob_partials,
                                        token_logprob_shard_backward)

Group = Optional[dist.ProcessGroup]

__all__ = ["vocab_parallel_token_logprob", "fused_linear_token_logprob"]


def _tp_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _vocab_layout(op: str, shard_size: int, vocab_start: int, vocab_size: Optional[int], group: Group):
    """(vocab_size, number of leading columns of the shard at `vocab_start` that are real ids)."""
    if vocab_start < 0:
        raise ValueError(f"{op}: vocab_start must be >= 0, got {vocab_start}")
    if vocab_size is None:
        vocab_size = shard_size * _tp_size(group)
    if vocab_size < 1:
        raise ValueError(f"{op}: vocab_size must be >= 1, got {vocab_size}")
    return vocab_size, min(shard_size, max(0, vocab_size - vocab_start))


def _combine_over_group(partials: torch.Tensor, targets: torch.Tensor, group: Group, ignore_index: int):
    """All-gather every rank's [N, 4] partials into [tp, N, 4] and merge them: (logp, lse, entropy) [N]."""
    size = _tp_size(group)
    if size == 1:
        gathered = partials.unsqueeze(0)
    else:
        gathered = partials.new_empty((size, *partials.shape))
        dist.all_gather(list(gathered.unbind(0)), partials.contiguous(), group=group)
    return combine_vocab_partials(gathered, targets, ignore_index)


def _shard_grad(logits: torch.Tensor, valid: int, targets, lse, entropy, grad_logp, grad_entropy,
                vocab_start: int, temperature: float, ignore_index: int, inplace: bool) -> torch.Tensor:
    """d loss / d logits [N, Vs] for one shard whose first `valid` columns are real ids (the rest zero)."""
    if valid == logits.shape[1]:
        return token_logprob_shard_backward(logits, targets, lse, entropy, grad_logp, grad_entropy,
                                            vocab_start, temperature, ignore_index, inplace=inplace)
    # One [N, Vs] buffer either way (the logits themselves when inplace): the valid columns become
    # their gradient in place, the padding tail is zeroed.
    grad = logits if inplace else logits.clone(memory_format=torch.contiguous_format)
    token_logprob_shard_backward(grad[:, :valid], targets, lse, entropy, grad_logp, grad_entropy,
                                 vocab_start, temperature, ignore_index, inplace=True)
    grad[:, valid:].zero_()
    return grad


def _upstream(lse: torch.Tensor, entropy, grad_logp, grad_entropy):
    """Replace a missing logp gradient by zeros; drop the entropy term when it receives no gradient."""
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    if entropy is None or grad_entropy is None:
        return grad_logp.contiguous(), None, None
    return grad_logp.contiguous(), entropy, grad_entropy.contiguous()


class _VocabParallelTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, valid, vocab_size, temperature, ignore_index,
                return_entropy, inplace_backward):
        partials = token_logprob_partials(logits[:, :valid], targets, vocab_start, temperature,
                                          ignore_index, return_entropy, vocab_size)
        logp, lse, entropy = _combine_over_group(partials, targets, group, ignore_index)
        ctx.save_for_backward(logits, targets, lse, entropy if return_entropy else None)
        ctx.args = (valid, vocab_start, temperature, ignore_index, inplace_backward)
        ctx.set_materialize_grads(False)
        return (logp, entropy) if return_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        # No collective: grad_logp / grad_entropy are replicated across tp (module docstring).
        logits, targets, lse, entropy = ctx.saved_tensors
        valid, vocab_start, temperature, ignore_index, inplace = ctx.args
        grad_logp, entropy, grad_entropy = _upstream(lse, entropy, grad_logp, grad_entropy)
        grad = _shard_grad(logits, valid, targets, lse, entropy, grad_logp, grad_entropy, vocab_start,
                           temperature, ignore_index, inplace)
        return grad, None, None, None, None, None, None, None, None, None


def vocab_parallel_token_logprob(logits_shard: torch.Tensor, targets: torch.Tensor, group: Group,
                                 vocab_start: int, temperature: float = 1.0, ignore_index: int = -100,
                                 return_entropy: bool = False, vocab_size: Optional[int] = None,
                                 inplace_backward: bool = False):
    """log p(target) (and entropy) from logits split over the vocabulary across `group`.

    Args:
        logits_shard: [..., Vs] this rank's logits for global ids [vocab_start, vocab_start + Vs),
            float32/float64/bfloat16/float16.
        targets: [...] int64 global ids, or ignore_index; the same on every rank.
        group: the tensor-parallel group (None: a single shard, no collective).
        vocab_start: global id of this shard's first column (rank * Vs in Megatron's layout).
        temperature: divides the logits, > 0.
        ignore_index: target id whose row gives 0 and no gradient.
        return_entropy: also return the entropy of softmax(logits / temperature) (differentiable).
        vocab_size: the unpadded vocabulary; shard columns at ids >= vocab_size are padding and
            are ignored (module docstring). None: every column is a real id (vocabulary Vs * tp).
        inplace_backward: the backward writes the gradient into `logits_shard` (as
            `token_logprob(inplace_backward=True)`), saving a [N, Vs] allocation; the logits must not
            be used after backward.

    Returns:
        logp [...] fp32 (fp64 for fp64 logits), or (logp, entropy); identical on every rank.
    """
    if logits_shard.dim() < 1:
        raise ValueError(f"vocab_parallel_token_logprob: logits_shard must have a vocabulary dim, got shape "
                         f"{tuple(logits_shard.shape)}")
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(f"vocab_parallel_token_logprob: targets must have shape logits_shard.shape[:-1] = "
                         f"{tuple(logits_shard.shape[:-1])}, got {tuple(targets.shape)}")
    shard = logits_shard.shape[-1]
    vocab_size, valid = _vocab_layout("vocab_parallel_token_logprob", shard, vocab_start, vocab_size, group)
    out = _VocabParallelTokenLogprob.apply(
        logits_shard.reshape(-1, shard), targets.reshape(-1), group, int(vocab_start), valid, vocab_size,
        float(temperature), int(ignore_index), bool(return_entropy), bool(inplace_backward))
    if return_entropy:
        return out[0].reshape(targets.shape), out[1].reshape(targets.shape)
    return out.reshape(targets.shape)


_FP32_OUT_ADDMM: dict[str, bool] = {}


def _fp32_out_addmm(device: torch.device) -> bool:
    """Whether this torch accumulates a bf16/fp16 product into an fp32 buffer in the GEMM itself
    (`torch.addmm(buf, a, b, out_dtype=torch.float32, out=buf)`, CUDA, torch >= 2.8); asked once
    per device type with a tiny call."""
    if device.type not in _FP32_OUT_ADDMM:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            buf = torch.ones(2, 2, device=device)
            torch.addmm(buf, a, a, out_dtype=torch.float32, out=buf)
            _FP32_OUT_ADDMM[device.type] = bool((buf == 3).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_ADDMM[device.type] = False
    return _FP32_OUT_ADDMM[device.type]


def _chunks(n: int, chunk_size: int):
    return [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]


class _FusedLinearTokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_start, valid, vocab_size, chunk_size, temperature,
                ignore_index, return_entropy):
        w = weight[:valid]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        partials = hidden.new_empty((hidden.shape[0], 4), dtype=acc)
        for s, e in _chunks(hidden.shape[0], chunk_size):
            partials[s:e] = token_logprob_partials(F.linear(hidden[s:e], w), targets[s:e], vocab_start,
                                                   temperature, ignore_index, return_entropy, vocab_size)
        logp, lse, entropy = _combine_over_group(partials, targets, group, ignore_index)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if return_entropy else None)
        ctx.args = (group, valid, vocab_start, chunk_size, temperature, ignore_index)
        ctx.set_materialize_grads(False)
        return (logp, entropy) if return_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        group, valid, vocab_start, chunk_size, temperature, ignore_index = ctx.args
        grad_logp, entropy, grad_entropy = _upstream(lse, entropy, grad_logp, grad_entropy)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        w = weight[:valid]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # fp32/fp64 weights accumulate their gradient in place; bf16/fp16 ones in an fp32 buffer,
        # so the sum over chunks is not rounded to 8 (11) mantissa bits at every chunk.
        low_precision = weight.dtype in (torch.bfloat16, torch.float16)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32 if low_precision else weight.dtype,
                                  device=weight.device) if need_weight else None
        # Where the GEMM can write fp32 (CUDA), the chunk's product is accumulated into the buffer
        # by the GEMM itself; else a [Vs, H] product in the weight dtype is made and then added,
        # which reads and writes the fp32 buffer once more per chunk.
        fused_accumulate = need_weight and low_precision and _fp32_out_addmm(weight.device)
        for s, e in _chunks(hidden.shape[0], chunk_size):
            h = hidden[s:e]
            grad_logits = F.linear(h, w)  # recomputed, then overwritten by its own gradient
            token_logprob_shard_backward(
                grad_logits, targets[s:e], lse[s:e], None if entropy is None else entropy[s:e], grad_logp[s:e],
                None if grad_entropy is None else grad_entropy[s:e], vocab_start, temperature, ignore_index,
                inplace=True)
            if need_hidden:
                torch.mm(grad_logits, w, out=grad_hidden[s:e])
            if fused_accumulate:
                torch.addmm(grad_weight[:valid], grad_logits.t(), h, out_dtype=torch.float32, out=grad_weight[:valid])
            elif need_weight and low_precision:
                grad_weight[:valid] += grad_logits.t() @ h
            elif need_weight:
                grad_weight[:valid].addmm_(grad_logits.t(), h)
            del grad_logits  # else it lives on while the next chunk's logits are allocated: two chunks at peak
        if need_hidden and _tp_size(group) > 1:
            # hidden is replicated across tp and each rank's grad covers only its vocab shard:
            # the full gradient is the sum (Megatron's copy_to_group backward).
            dist.all_reduce(grad_hidden, group=group)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def fused_linear_token_logprob(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor,
                               group: Group = None, vocab_start: int = 0, chunk_size: int = 1024,
                               temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                               vocab_size: Optional[int] = None):
    """log p(target) (and entropy) of `hidden @ weight_shard^T` without materialising the [N, V] logits.

    Args:
        hidden: [..., H] final hidden states, replicated across `group` (float32/float64/bfloat16/float16).
        weight_shard: [Vs, H] this rank's rows of the LM head (a `ColumnParallelLinear` weight or the
            whole head at tp = 1), ids [vocab_start, vocab_start + Vs); same dtype as hidden. No bias:
            LLM heads (Llama, Qwen2, Qwen3, Mistral) have none.
        targets: [...] int64 global ids, or ignore_index; the same on every rank.
        group: the tensor-parallel group (None: plain single-device use, no collective).
        vocab_start: global id of the shard's first row.
        chunk_size: tokens per chunk; the only [tokens, vocab] temporary is [chunk_size, Vs] in the
            hidden dtype. Smaller chunks save memory at the cost of smaller matmuls.
        temperature, ignore_index, return_entropy, vocab_size: as in `vocab_parallel_token_logprob`.

    Returns:
        logp [...] fp32 (fp64 for fp64 inputs), or (logp, entropy); identical on every rank.

    Gradients: d/d hidden is all-reduced over `group` (hidden entered the group replicated);
    d/d weight_shard is this rank's rows of the full gradient (zero for padding rows), accumulated
    over chunks in the weight dtype for fp32/fp64 and in an fp32 [Vs, H] buffer for bf16/fp16.
    Backward costs one more logits matmul than the eager path (the recompute).
    """
    op = "fused_linear_token_logprob"
    if hidden.dim() < 1 or weight_shard.dim() != 2 or hidden.shape[-1] != weight_shard.shape[1]:
        raise ValueError(f"{op}: need hidden [..., H] and weight_shard [Vs, H], got hidden "
                         f"{tuple(hidden.shape)} and weight_shard {tuple(weight_shard.shape)}")
    if hidden.dtype != weight_shard.dtype:
        raise TypeError(f"{op}: hidden ({hidden.dtype}) and weight_shard ({weight_shard.dtype}) must have one dtype")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"{op}: targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be >= 1, got {chunk_size}")
    vocab_size, valid = _vocab_layout(op, weight_shard.shape[0], vocab_start, vocab_size, group)
    out = _FusedLinearTokenLogprob.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight_shard, targets.reshape(-1), group, int(vocab_start), valid,
        vocab_size, int(chunk_size), float(temperature), int(ignore_index), bool(return_entropy))
    if return_entropy:
        return out[0].reshape(targets.shape), out[1].reshape(targets.shape)
    return out.reshape(targets.shape)
