"""Vocab-parallel and fused linear + log-prob against the dense full-vocab computation.

The reference is always `log_softmax(hidden @ W^T / T).gather(target)` and -sum p log p over the
whole [N, V] logits, with autograd for every gradient; the loss is <u, logp> + <v, entropy> with
fixed u, v, the same on every rank. A rank's logits (weight) gradient must equal its columns (rows)
of the dense gradient, zero on the padding; the hidden gradient must equal the dense one on every
rank. Padding columns / rows are filled with NaN: any read of them would poison the result.
"""
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from conftest import TOL
from megalign.ops.token_logprob import token_logprob
from megalign.parallel.layers import pad_vocab_size
from megalign.parallel.layout import ParallelLayout
from megalign.parallel.logprob import fused_linear_token_logprob, vocab_parallel_token_logprob

from .dist_utils import run_distributed

IGNORE = -100
F32, F64 = torch.float32, torch.float64


def _problem(n: int, vocab: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """hidden [n, H], full head [V, H], targets (every third row ignored), upstream weights u, v [n]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=F64).to(dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=F64).to(dtype)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[1::3] = IGNORE
    out = F64 if dtype == F64 else F32
    u, v = torch.randn(2, n, generator=g, dtype=F64).to(out)
    return h, w, t, u, v


def _dense(h, w, t, u, v, temperature):
    """Full-vocab reference: logp, entropy and the gradients w.r.t. logits, hidden and weight."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logits = h @ w.T
    logits.retain_grad()
    logp_all = torch.log_softmax(logits.to(u.dtype) / temperature, dim=-1)
    ignored = t == IGNORE
    logp = logp_all.gather(-1, t.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    entropy = -(logp_all.exp() * logp_all).sum(-1).masked_fill(ignored, 0.0)
    ((u * logp).sum() + (v * entropy).sum()).backward()
    return dict(logits=logits.detach(), logp=logp.detach(), entropy=entropy.detach(),
                g_logits=logits.grad, g_hidden=h.grad, g_weight=w.grad)


def _pad_shard(x: torch.Tensor, dim: int, padded: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of `x` padded with NaN to `padded` along `dim` (a copy)."""
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, padded - x.shape[dim]]
    full = F.pad(x, pad, value=float("nan"))
    part = padded // tp
    return full.narrow(dim, rank * part, part).clone()


def _zero_pad_shard(x: torch.Tensor, dim: int, padded: int, tp: int, rank: int) -> torch.Tensor:
    """The expected gradient shard: the dense gradient's part, zero on the padding."""
    return _pad_shard(x, dim, padded, tp, rank).nan_to_num(0.0)


def _check_vocab_parallel(group, tp, rank, n, vocab, multiple, dtype, temperature, inplace):
    h, w, t, u, v = _problem(n, vocab, 8, dtype, seed=vocab + n)
    ref = _dense(h, w, t, u, v, temperature)
    padded = pad_vocab_size(vocab, tp, multiple)
    shard = _pad_shard(ref["logits"], 1, padded, tp, rank).requires_grad_()
    # the function sees a non-leaf, so with inplace_backward it overwrites that buffer, not `shard`
    logp, entropy = vocab_parallel_token_logprob(
        shard * 1, t, group, rank * (padded // tp), temperature, IGNORE, return_entropy=True, vocab_size=vocab,
        inplace_backward=inplace)
    ((u * logp).sum() + (v * entropy).sum()).backward()
    assert_close(logp, ref["logp"], **TOL[dtype])
    assert_close(entropy, ref["entropy"], **TOL[dtype])
    assert_close(shard.grad, _zero_pad_shard(ref["g_logits"].to(dtype), 1, padded, tp, rank), **TOL[dtype])


def _check_fused(group, tp, rank, n, vocab, multiple, dtype, temperature, chunk_size):
    h, w, t, u, v = _problem(n, vocab, 8, dtype, seed=vocab + n)
    ref = _dense(h, w, t, u, v, temperature)
    padded = pad_vocab_size(vocab, tp, multiple)
    hidden = h.clone().requires_grad_()
    weight = _pad_shard(w, 0, padded, tp, rank).requires_grad_()
    logp, entropy = fused_linear_token_logprob(
        hidden, weight, t, group, rank * (padded // tp), chunk_size, temperature, IGNORE, return_entropy=True,
        vocab_size=vocab)
    ((u * logp).sum() + (v * entropy).sum()).backward()
    assert_close(logp, ref["logp"], **TOL[dtype])
    assert_close(entropy, ref["entropy"], **TOL[dtype])
    assert_close(hidden.grad, ref["g_hidden"], **TOL[dtype])
    assert_close(weight.grad, _zero_pad_shard(ref["g_weight"], 0, padded, tp, rank), **TOL[dtype])


# ---------------------------------------------------------------- single process (group None)

@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("inplace", [False, True])
def test_vocab_parallel_one_shard_matches_dense(dtype, temperature, inplace):
    # vocab 11 in a shard of 16: five NaN padding columns
    _check_vocab_parallel(None, 1, 0, 7, 11, 16, dtype, temperature, inplace)
    _check_vocab_parallel(None, 1, 0, 1, 11, 1, dtype, temperature, inplace)


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_both_op_backends(backend, request):
    """The functions use only megalign.ops' public API, so the pure-torch fallback serves them too."""
    request.getfixturevalue(backend)
    _check_vocab_parallel(None, 1, 0, 7, 11, 16, F64, 0.7, True)
    _check_fused(None, 1, 0, 7, 11, 16, F64, 0.7, chunk_size=3)


def test_vocab_parallel_group_none_is_the_plain_op():
    h, w, t, _, _ = _problem(5, 13, 8, F32)
    x = (h @ w.T).requires_grad_()
    ours = vocab_parallel_token_logprob(x, t, None, 0, 0.5, return_entropy=True)
    y = x.detach().clone().requires_grad_()
    plain = token_logprob(y, t, 0.5, return_entropy=True)
    assert_close(ours, plain, **TOL[F32])
    sum(ours).sum().backward()
    sum(plain).sum().backward()
    assert_close(x.grad, y.grad, **TOL[F32])


def test_vocab_parallel_leading_dims_and_logp_only():
    h, w, t, _, _ = _problem(6, 9, 8, F64)
    logits = (h @ w.T).reshape(2, 3, 9)
    logp = vocab_parallel_token_logprob(logits, t.reshape(2, 3), None, 0)
    ref = _dense(h, w, t, torch.zeros(6, dtype=F64), torch.zeros(6, dtype=F64), 1.0)["logp"]
    assert_close(logp, ref.reshape(2, 3), **TOL[F64])


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("n,chunk_size", [(7, 1), (7, 3), (7, 7), (7, 1024), (1, 2)])
def test_fused_single_device_matches_dense(dtype, n, chunk_size):
    _check_fused(None, 1, 0, n, 11, 16, dtype, 0.7, chunk_size)


def test_fused_chunked_equals_unchunked():
    h, w, t, u, v = _problem(10, 17, 8, F32)
    results = []
    for chunk_size in (3, 10):
        hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, entropy = fused_linear_token_logprob(hidden, weight, t, chunk_size=chunk_size, return_entropy=True)
        ((u * logp).sum() + (v * entropy).sum()).backward()
        results.append((logp, entropy, hidden.grad, weight.grad))
    assert_close(results[0], results[1], **TOL[F32])


def test_fused_entropy_only_and_logp_only_gradients():
    """A loss on one output only: the other output's missing gradient counts as zero."""
    h, w, t, u, v = _problem(5, 13, 8, F64)
    for which, uu, vv in (("logp", u, torch.zeros_like(v)), ("entropy", torch.zeros_like(u), v)):
        ref = _dense(h, w, t, uu, vv, 1.0)
        hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, entropy = fused_linear_token_logprob(hidden, weight, t, chunk_size=2, return_entropy=True)
        ((uu * logp).sum() if which == "logp" else (vv * entropy).sum()).backward()
        assert_close(hidden.grad, ref["g_hidden"], **TOL[F64])
        assert_close(weight.grad, ref["g_weight"], **TOL[F64])


def test_fused_bf16_no_worse_than_eager_bf16():
    """bf16 logits round at ~2^-8: the fused path may err no more than twice the eager bf16 path
    (bf16 matmul, fp32 log_softmax), both against the fp32 dense result of the same bf16 inputs."""
    h, w, t, u, _ = _problem(16, 64, 32, torch.bfloat16)
    ref = _dense(h.float(), w.float(), t, u, torch.zeros_like(u), 1.0)
    eager = _dense(h, w, t, u, torch.zeros_like(u), 1.0)
    hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp = fused_linear_token_logprob(hidden, weight, t, chunk_size=5)
    (u * logp).sum().backward()
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
    for ours, theirs, key in ((logp, eager["logp"], "logp"), (hidden.grad, eager["g_hidden"], "g_hidden"),
                              (weight.grad, eager["g_weight"], "g_weight")):
        err = (ours.float() - ref[key]).abs().max()
        assert err <= 2 * (theirs.float() - ref[key]).abs().max() + 1e-3, key


def test_bad_input_names_the_argument():
    h, w, t, _, _ = _problem(4, 9, 8, F32)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_token_logprob(h, w, t, chunk_size=0)
    with pytest.raises(TypeError, match="weight_shard"):
        fused_linear_token_logprob(h, w.double(), t)
    with pytest.raises(ValueError, match="weight_shard"):
        fused_linear_token_logprob(h, w[:, :5], t)
    with pytest.raises(ValueError, match="targets"):
        fused_linear_token_logprob(h, w, t[:3])
    with pytest.raises(ValueError, match="vocab_start"):
        vocab_parallel_token_logprob(h @ w.T, t, None, -1)
    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_token_logprob(h @ w.T, t[:3], None, 0)
    with pytest.raises(IndexError, match="targets"):  # a target in the padding is not a real id
        vocab_parallel_token_logprob(h @ w.T, torch.full((4,), 8), None, 0, vocab_size=8)
    with pytest.raises(IndexError, match="targets"):  # without vocab_size the vocabulary is Vs * tp
        fused_linear_token_logprob(h, w, torch.full((4,), 9))


# ---------------------------------------------------------------- tp = 2 (and tp = 1 with dp = 2)

def _check_tp():
    for layout in (ParallelLayout.build(tp=2), ParallelLayout.build(tp=1)):
        group, tp, rank = layout.tp_group, layout.tp, layout.tp_rank
        # (vocab, pad multiple): divisible; 11 -> 12 (rank 1 has one padding column);
        # 3 -> 8 (rank 1's shard is all padding)
        for vocab, multiple in ((12, 1), (11, 1), (3, 4)):
            for dtype, temperature in ((F64, 0.7), (F32, 1.0)):
                for inplace in (False, True):
                    _check_vocab_parallel(group, tp, rank, 7, vocab, multiple, dtype, temperature, inplace)
                _check_fused(group, tp, rank, 7, vocab, multiple, dtype, temperature, chunk_size=3)
            _check_fused(group, tp, rank, 1, vocab, multiple, F64, 1.3, chunk_size=1024)
        _check_collective_counts(group, tp, rank)


def _check_collective_counts(group, tp, rank):
    """The fused path issues one all-gather in forward (whatever the chunk count) and one all-reduce in
    backward; vocab-parallel one all-gather and nothing in backward. None at all for one rank."""
    h, w, t, _, _ = _problem(9, 10, 8, F32)
    with mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as gather, \
            mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce) as reduce:
        hidden = h.clone().requires_grad_()
        weight = _pad_shard(w, 0, 10, tp, rank).requires_grad_()
        logp = fused_linear_token_logprob(hidden, weight, t, group, rank * (10 // tp), chunk_size=2)
        assert (gather.call_count, reduce.call_count) == (int(tp > 1), 0)
        logp.sum().backward()
        assert (gather.call_count, reduce.call_count) == (int(tp > 1), int(tp > 1))
        logits = _pad_shard(h @ w.T, 1, 10, tp, rank).requires_grad_()
        vocab_parallel_token_logprob(logits, t, group, rank * (10 // tp)).sum().backward()
        assert (gather.call_count, reduce.call_count) == (2 * int(tp > 1), int(tp > 1))


def test_tp2_matches_dense():
    run_distributed(_check_tp)
