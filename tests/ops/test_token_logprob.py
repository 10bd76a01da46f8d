"""token_logprob: kernels and the pure-torch reference each against a float64 oracle (forward, logp
and entropy gradients), the reference vs hand-worked numbers, vocab-parallel shards vs the
unsharded op, edge cases and bad-input errors."""
import importlib
import math

import pytest
import torch
from conftest import TOL, assert_close_to_oracle, requires_cuda

from megalign.ops.reference.token_logprob import token_logprob as ref_token_logprob
from megalign.ops.token_logprob import (combine_vocab_partials, token_logprob,
                                        token_logprob_partials, token_logprob_shard_backward)

ref_module = importlib.import_module("megalign.ops.reference.token_logprob")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# k of the oracle rule (conftest.assert_close_to_oracle) per result. The backward reads the lse and
# entropy the forward saved in fp32, so its gradient carries their rounding (a few ulp of |H| ~ 12,
# times g_H p_j), which autograd through plain torch does not: measured at V = 151936 its error is
# up to ~2.5x (16 rows) to ~4.5x (2 rows) torch's, against < 1x for logp and the entropy.
K = {"logp": 2.0, "entropy": 2.0, "grad": 5.0}


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _inputs(n, v, dtype, device="cpu", scale=3.0, ignore_every=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -100
    return logits, targets.to(device)


def _run(fn, logits, targets, seed=1, weight_dtype=None, **kw):
    """Forward (logp, entropy) and the gradient of a random linear loss on both.

    The loss weights are drawn in weight_dtype (default: logp's dtype) and then cast to logp's, so
    an fp64 oracle run can use exactly the weights of the fp32 run it checks.
    """
    x = logits.detach().clone().requires_grad_()
    logp, ent = fn(x, targets, return_entropy=True, **kw)
    g = torch.Generator().manual_seed(seed)
    wd = weight_dtype or logp.dtype
    w1 = torch.randn(logp.shape, generator=g, dtype=wd).to(logp.device, logp.dtype)
    w2 = torch.randn(logp.shape, generator=g, dtype=wd).to(logp.device, logp.dtype)
    (grad,) = torch.autograd.grad((logp * w1).sum() + (ent * w2).sum(), x)
    return logp.detach(), ent.detach(), grad


def _plain_torch(logits, targets, temperature=1.0, ignore_index=-100, return_entropy=True):
    """token_logprob written the plain torch way, in _acc(logits.dtype): fp32 gives torch's own
    error in the op's precision, fp64 logits give the oracle."""
    z = logits.to(_acc(logits.dtype)) / temperature
    logp_all = z - torch.logsumexp(z, -1, keepdim=True)
    ignored = targets == ignore_index
    logp = logp_all.gather(-1, targets.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    finite_logp = logp_all.masked_fill(logp_all == float("-inf"), 0.0)
    entropy = -(logp_all.exp() * finite_logp).sum(-1)
    return logp.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0)


def _oracle_and_torch(logits, targets, **kw):
    """(float64 oracle, plain torch in the op's precision), each (logp, entropy, grad), on the same inputs."""
    weights = _acc(logits.dtype)
    oracle = _run(_plain_torch, logits.double(), targets, weight_dtype=weights, **kw)
    return oracle, _run(_plain_torch, logits, targets, weight_dtype=weights, **kw)


def _check(name, got, oracle, eager, dtype):
    """got = (logp, entropy, grad) against the oracle: the oracle rule, or TOL for fp64 inputs."""
    for what, a, o, t in zip(("logp", "entropy", "grad"), got, oracle, eager):
        if dtype == torch.float64:
            torch.testing.assert_close(a, o, **TOL[torch.float64], msg=lambda m: f"{name} {what}: {m}")
        else:
            assert_close_to_oracle(a, o, t, k=K[what], name=f"{name} {what}")


def _compare(logits, targets, **kw):
    """Kernel and reference each against the float64 oracle: logp, entropy and the logits gradient."""
    oracle, eager = _oracle_and_torch(logits, targets, **kw)
    for name, fn in (("kernel", token_logprob), ("reference", ref_token_logprob)):
        got = _run(fn, logits, targets, weight_dtype=_acc(logits.dtype), **kw)
        assert got[0].dtype == got[1].dtype == _acc(logits.dtype) and got[2].dtype == logits.dtype, name
        _check(name, got, oracle, eager, logits.dtype)


# ---------------------------------------------------------------- reference vs hand-worked numbers

def test_reference_hand_worked():
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]], dtype=torch.float64)
    logp, ent = ref_token_logprob(logits, torch.tensor([0, 1]), return_entropy=True)
    torch.testing.assert_close(logp, torch.tensor([math.log(0.25), math.log(0.75)], dtype=torch.float64))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([h, h], dtype=torch.float64))
    # temperature 2: logits [0, ln 9] / 2 = [0, ln 3]
    logp_t = ref_token_logprob(torch.tensor([[0.0, math.log(9.0)]], dtype=torch.float64),
                               torch.tensor([1]), temperature=2.0)
    torch.testing.assert_close(logp_t, torch.tensor([math.log(0.75)], dtype=torch.float64))
    # d logp_t / dz = 1[j = t] - p = [-1/4, 1/4]
    x = logits[:1].clone().requires_grad_()
    ref_token_logprob(x, torch.tensor([1])).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[-0.25, 0.25]], dtype=torch.float64))


def test_reference_minus_inf_and_ignored_hand_worked():
    logits = torch.tensor([[0.0, float("-inf"), 0.0], [1.0, 2.0, 3.0]], dtype=torch.float64, requires_grad=True)
    logp, ent = ref_token_logprob(logits, torch.tensor([2, -100]), return_entropy=True)
    torch.testing.assert_close(logp, torch.tensor([math.log(0.5), 0.0], dtype=torch.float64))
    torch.testing.assert_close(ent, torch.tensor([math.log(2.0), 0.0], dtype=torch.float64))
    (logp.sum() + ent.sum()).backward()
    # dH/dz_j = -p_j (log p_j + H) = 0 at the uniform distribution; dlogp/dz = [-1/2, 0, 1/2]
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.5, 0.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float64))


def test_reference_gradcheck():
    logits, targets = _inputs(4, 7, torch.float64, ignore_every=3)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: ref_token_logprob(z, targets, temperature=0.8), (x,))
    assert torch.autograd.gradcheck(
        lambda z: ref_token_logprob(z, targets, temperature=1.3, return_entropy=True), (x,))


def test_reference_row_chunks(monkeypatch):
    # The float64 work runs over chunks of at most CHUNK_ELEMENTS // V rows (at least one row).
    assert [(c.start, c.stop) for c in ref_module._row_chunks(7, 3)] == [(0, 7)]
    assert len(ref_module._row_chunks(3, ref_module.CHUNK_ELEMENTS * 2)) == 3
    logits, targets = _inputs(7, 300, torch.float32, ignore_every=3)
    logits[2, :100] = float("-inf")
    kw = dict(temperature=0.8)
    whole = _run(ref_token_logprob, logits, targets, **kw)
    whole_partials = ref_module.token_logprob_partials(logits, targets, 0, with_entropy=True, **kw)
    monkeypatch.setattr(ref_module, "CHUNK_ELEMENTS", 2 * 300)
    assert len(ref_module._row_chunks(7, 300)) == 4  # 2 + 2 + 2 + 1 rows
    for a, b in zip(_run(ref_token_logprob, logits, targets, **kw), whole):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(ref_module.token_logprob_partials(logits, targets, 0, with_entropy=True, **kw),
                               whole_partials)


def test_kernel_hand_worked(kernels):
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    logp, ent = token_logprob(logits, torch.tensor([0, 1]), return_entropy=True)
    torch.testing.assert_close(logp, torch.tensor([math.log(0.25), math.log(0.75)]))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([h, h]))


# ---------------------------------------------------------------- kernel vs reference

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1, 2, 50257])
def test_matches_reference(kernels, dtype, v):
    logits, targets = _inputs(5, v, dtype, ignore_every=4)
    _compare(logits, targets)


@pytest.mark.parametrize("dtype", DTYPES)
def test_temperature(kernels, dtype):
    logits, targets = _inputs(6, 3001, dtype, ignore_every=5)
    _compare(logits, targets, temperature=0.7)
    _compare(logits, targets, temperature=1.9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qwen_vocab(kernels, dtype):
    # 16 rows, so that torch's own error (the yardstick of the oracle rule) is a max over enough rows.
    logits, targets = _inputs(16, 151936, dtype, ignore_every=7)
    _compare(logits, targets)


def test_logp_only_gradient(kernels):
    logits, targets = _inputs(4, 777, torch.float64, ignore_every=3)
    x = logits.clone().requires_grad_()
    token_logprob(x, targets).sum().backward()
    y = logits.clone().requires_grad_()
    ref_token_logprob(y, targets).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, **TOL[torch.float64])


def test_gradcheck(kernels):
    logits, targets = _inputs(4, 7, torch.float64, ignore_every=3)
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda z: token_logprob(z, targets, temperature=0.8), (x,))
    assert torch.autograd.gradcheck(
        lambda z: token_logprob(z, targets, temperature=1.3, return_entropy=True), (x,))


def test_zero_and_one_rows(kernels):
    logits, targets = _inputs(0, 11, torch.float32)
    x = logits.requires_grad_()
    logp, ent = token_logprob(x, targets, return_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert x.grad.shape == (0, 11)
    _compare(*_inputs(1, 11, torch.float32))


def test_leading_dims(kernels):
    logits, targets = _inputs(2 * 3, 101, torch.float32)
    logits, targets = logits.reshape(2, 3, 101), targets.reshape(2, 3)
    targets[1, 2] = -100
    logp = token_logprob(logits, targets)
    assert logp.shape == (2, 3)
    _compare(logits, targets)


def test_non_contiguous(kernels):
    big, _ = _inputs(6, 131, torch.float32)
    targets = torch.randint(0, 100, (6,))
    _compare(big[:, 1:101], targets)                          # row stride 131, unaligned start
    _compare(big[::2, :100], targets[::2])                    # strided rows and targets
    _compare(big[:, :100].t().contiguous().t(), targets)      # vocab dim not unit-stride
    tbv, _ = _inputs(4 * 3, 57, torch.bfloat16)
    _compare(tbv.reshape(4, 3, 57).transpose(0, 1), torch.randint(0, 57, (3, 4)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(kernels, dtype):
    logits, targets = _inputs(6, 300, dtype)
    logits[0, :] = 1e4
    logits[0, 5] = -1e4
    logits[1, ::2] = -1e4
    logits[2, :150] = float("-inf")
    logits[3, 1:] = float("-inf")
    targets[3] = 0
    logits[4, 7] = 1e4
    targets[4] = 7
    _compare(logits, targets)
    logp, ent, grad = _run(token_logprob, logits, targets)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()


def test_all_ignored(kernels):
    logits, targets = _inputs(5, 64, torch.float32)
    targets[:] = -1
    x = logits.requires_grad_()
    logp, ent = token_logprob(x, targets, ignore_index=-1, return_entropy=True)
    assert (logp == 0).all() and (ent == 0).all()
    (logp.sum() + ent.sum()).backward()
    assert (x.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward(kernels, dtype):
    logits, targets = _inputs(4, 513, dtype, ignore_every=3)
    oracle, eager = _oracle_and_torch(logits, targets)
    x = logits.clone().requires_grad_()
    buf = x.detach()
    logp, ent = token_logprob(x, targets, return_entropy=True, inplace_backward=True)
    g = torch.Generator().manual_seed(1)  # the weights of _run
    w1 = torch.randn(logp.shape, generator=g)
    w2 = torch.randn(logp.shape, generator=g)
    (grad,) = torch.autograd.grad((logp * w1).sum() + (ent * w2).sum(), x)
    assert_close_to_oracle(grad, oracle[2], eager[2], k=K["grad"], name="inplace grad")
    assert grad.data_ptr() == x.data_ptr()
    assert torch.equal(buf, grad)  # the logits buffer now holds the gradient


# ---------------------------------------------------------------- vocab-parallel blocks

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
# [61, 0, 40]: the middle rank holds only padding (an empty shard).
@pytest.mark.parametrize("sizes", [[50, 51], [10, 1, 90], [40, 40, 40, 31], [1, 1, 1, 148], [61, 0, 40]])
@pytest.mark.parametrize("path", ["kernels", "reference"])
def test_vocab_parallel(sizes, path, dtype, request):
    request.getfixturevalue(path)
    v = sum(sizes)
    logits, targets = _inputs(7, v, dtype, ignore_every=3)
    logits[1, :60] = float("-inf")  # whole shards of -inf
    kw = dict(temperature=0.9)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    shards = torch.split(logits, sizes, dim=-1)
    partials = torch.stack([token_logprob_partials(s.contiguous(), targets, st, with_entropy=True, vocab_size=v, **kw)
                            for s, st in zip(shards, starts)])
    logp, lse, ent = combine_vocab_partials(partials, targets, -100)
    g = torch.Generator().manual_seed(1)  # the same upstream gradients as _run
    w1 = torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    w2 = torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    grad = torch.cat([token_logprob_shard_backward(s, targets, lse, ent, w1, w2, st, **kw)
                      for s, st in zip(shards, starts)], dim=-1)
    oracle, eager = _oracle_and_torch(logits, targets, **kw)
    _check("sharded", (logp, ent, grad), oracle, eager, dtype)
    assert_close_to_oracle(lse, torch.logsumexp(logits.double() / 0.9, -1).masked_fill(targets == -100, 0.0),
                           torch.logsumexp(logits / 0.9, -1).masked_fill(targets == -100, 0.0), name="lse")
    ulogp, uent = token_logprob(logits, targets, return_entropy=True, **kw)
    _check("unsharded", (ulogp, uent, grad), oracle, eager, dtype)


def test_partials_fp32_shards_match_unsharded(kernels):
    logits, targets = _inputs(5, 1000, torch.float32, ignore_every=2)
    partials = torch.stack([token_logprob_partials(s, targets, st) for s, st in
                            zip(torch.split(logits, [333, 667], dim=-1), [0, 333])])
    logp, lse, _ = combine_vocab_partials(partials, targets, -100)
    oracle, eager = _oracle_and_torch(logits, targets)
    assert_close_to_oracle(logp, oracle[0], eager[0], name="sharded logp")
    assert_close_to_oracle(token_logprob(logits, targets), oracle[0], eager[0], name="unsharded logp")
    ignored = targets == -100
    assert_close_to_oracle(lse, torch.logsumexp(logits.double(), -1).masked_fill(ignored, 0.0),
                           torch.logsumexp(logits, -1).masked_fill(ignored, 0.0), name="lse")


def test_partials_columns(kernels):
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]], dtype=torch.float64)
    targets = torch.tensor([11, -100])
    p = token_logprob_partials(logits, targets, vocab_start=10, with_entropy=True)
    want = torch.tensor([[math.log(3.0), 1.0 + 1.0 / 3.0, math.log(3.0), -math.log(3.0) / 3.0],
                         [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(p, want)


# ---------------------------------------------------------------- bad input

def test_bad_inputs(kernels):
    logits, targets = _inputs(3, 10, torch.float32)
    with pytest.raises(TypeError, match="targets"):
        token_logprob(logits, targets.int())
    with pytest.raises(ValueError, match="targets"):
        token_logprob(logits, targets[:2])
    with pytest.raises(ValueError, match="targets"):
        token_logprob(logits, targets.to("meta"))
    with pytest.raises(TypeError, match="logits"):
        token_logprob(logits.int(), targets)
    with pytest.raises(ValueError, match="temperature"):
        token_logprob(logits, targets, temperature=0.0)
    bad = targets.clone()
    bad[2] = 10
    with pytest.raises(IndexError, match=r"targets.*flat row 2"):
        token_logprob(logits, bad)
    bad[2] = -5
    with pytest.raises(IndexError, match=r"targets.*flat row 2"):
        token_logprob(logits, bad)
    with pytest.raises(IndexError, match=r"targets.*flat row 2"):
        token_logprob_partials(logits, bad, 0)
    lse = torch.zeros(3)
    with pytest.raises(RuntimeError, match="lse"):
        torch.ops.megalign.token_logprob_bwd(logits, targets, lse.double(), None, lse, None, 0, 1.0, -100)
    with pytest.raises(RuntimeError, match="grad_logp"):
        torch.ops.megalign.token_logprob_bwd(logits, targets, lse, None, lse[:2], None, 0, 1.0, -100)
    with pytest.raises(ValueError, match="grad_entropy"):
        token_logprob_shard_backward(logits, targets, lse, lse, lse, None, 0)


def test_reference_bad_target():
    logits, targets = _inputs(3, 10, torch.float32)
    targets[1] = 99
    with pytest.raises(IndexError, match=r"targets.*flat row 1"):
        ref_token_logprob(logits, targets)


# ---------------------------------------------------------------- op registration

def test_opcheck(kernels):
    logits, targets = _inputs(4, 33, torch.float32, ignore_every=3)
    lse = torch.logsumexp(logits, -1)
    ent = torch.rand(4)
    g = torch.randn(4)
    ops = torch.ops.megalign
    torch.library.opcheck(ops.token_logprob_partials, (logits, targets, 0, 33, 1.0, -100, True))
    torch.library.opcheck(ops.token_logprob_fwd, (logits.requires_grad_(), targets, 0.5, -100, True, False))
    torch.library.opcheck(ops.token_logprob_bwd, (logits.detach(), targets, lse, ent, g, g, 0, 1.0, -100))
    torch.library.opcheck(ops.token_logprob_bwd_, (logits.detach().clone(), targets, lse, None, g, None, 0, 1.0, -100))


def test_compile(kernels):
    logits, targets = _inputs(3, 40, torch.float32)
    fn = torch.compile(lambda x, t: token_logprob(x, t, return_entropy=True), backend="aot_eager", fullgraph=True)
    logp, ent = fn(logits, targets)
    rlogp, rent = ref_token_logprob(logits, targets, return_entropy=True)
    torch.testing.assert_close(logp, rlogp)
    torch.testing.assert_close(ent, rent)


# ---------------------------------------------------------------- CUDA

@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v", [1, 2, 50257, 151936])
def test_cuda_matches_reference(kernels, dtype, v):
    logits, targets = _inputs(5, v, dtype, device="cuda", ignore_every=4)
    _compare(logits, targets)
    _compare(logits, targets, temperature=0.6)


@requires_cuda
def test_cuda_unaligned_and_strided(kernels):
    big, _ = _inputs(6, 1031, torch.bfloat16, device="cuda")
    targets = torch.randint(0, 1000, (6,), device="cuda")
    for off in range(4):
        _compare(big[:, off:off + 1000], targets)
    _compare(big[:, :1000].t().contiguous().t(), targets)


@requires_cuda
def test_cuda_extreme_and_inplace(kernels):
    logits, targets = _inputs(4, 3000, torch.float32, device="cuda")
    logits[0, :1500] = float("-inf")
    logits[1] *= 1e4
    _compare(logits, targets)
    oracle, eager = _oracle_and_torch(logits, targets)
    x = logits.clone().requires_grad_()
    logp, ent = token_logprob(x, targets, return_entropy=True, inplace_backward=True)
    g = torch.Generator().manual_seed(1)  # the weights of _run
    w1 = torch.randn(logp.shape, generator=g).cuda()
    w2 = torch.randn(logp.shape, generator=g).cuda()
    (grad,) = torch.autograd.grad((logp * w1).sum() + (ent * w2).sum(), x)
    assert_close_to_oracle(grad, oracle[2], eager[2], k=K["grad"], name="inplace grad")


@requires_cuda
def test_cuda_out_of_range_gives_nan(kernels):
    logits, targets = _inputs(3, 100, torch.float32, device="cuda")
    targets[1] = 100
    logp = token_logprob(logits, targets)
    assert torch.isnan(logp[1]) and torch.isfinite(logp[[0, 2]]).all()


@requires_cuda
def test_cuda_vocab_parallel(kernels):
    logits, targets = _inputs(5, 1001, torch.bfloat16, device="cuda", ignore_every=2)
    sizes, starts = [500, 1, 500], [0, 500, 501]
    shards = torch.split(logits, sizes, dim=-1)
    partials = torch.stack([token_logprob_partials(s, targets, st, with_entropy=True)
                            for s, st in zip(shards, starts)])
    logp, lse, ent = combine_vocab_partials(partials, targets, -100)
    oracle, eager = _oracle_and_torch(logits, targets)
    assert_close_to_oracle(logp, oracle[0], eager[0], name="sharded logp")
    assert_close_to_oracle(ent, oracle[1], eager[1], name="sharded entropy")


def _float64_logp_entropy(logits, targets):
    """log_softmax(logits)[target] and -sum p log p (0 log 0 = 0, for -inf logits) in float64, on the CPU: [N] each."""
    logp_all = logits.double().cpu().log_softmax(-1)
    p = logp_all.exp()
    return logp_all.gather(-1, targets.cpu()[:, None])[:, 0], -torch.special.xlogy(p, p).sum(-1)


def test_nan_logit_propagates(kernels):
    logits, targets = _inputs(3, 5000, torch.float32)
    logits[1, 4321] = float("nan")
    logp, ent = token_logprob(logits, targets, return_entropy=True)
    assert torch.isnan(logp[1]) and torch.isnan(ent[1])
    want_logp, want_ent = _float64_logp_entropy(logits, targets)
    torch.testing.assert_close(logp[[0, 2]].double(), want_logp[[0, 2]], **TOL[torch.float32])
    torch.testing.assert_close(ent[[0, 2]].double(), want_ent[[0, 2]], **TOL[torch.float32])


def _nan_cases(dtype, device):
    """(name, logits [N, V] view, NaN row) with the NaN where a GPU thread sees it first: an aligned
    row [NaN, 1.0], the first logit of a long row, the scalar head of a row that is not 16-byte
    aligned, the tail of a short row, a padded vocabulary (a [N, V] view of a wider buffer, as the
    fused head passes with V < its padded width), and a row whose other logits are all -inf."""
    def buf(n, v, seed):
        return _inputs(n, v, dtype, device, seed=seed)[0]
    aligned = torch.tensor([[0.5, 2.0], [float("nan"), 1.0]], dtype=dtype, device=device)
    long_first = buf(2, 5000, 1)
    long_first[1, 0] = float("nan")
    head = buf(2, 1031, 2)[:, 1:1025]
    head[1, 0] = float("nan")
    tail = buf(2, 7, 3)
    tail[1, 6] = float("nan")
    padded = buf(2, 1024, 4)[:, :1001]
    padded[1, 1000] = float("nan")
    only_inf = torch.full((2, 300), float("-inf"), dtype=dtype, device=device)
    only_inf[0, 0] = 1.0
    only_inf[1, 150] = float("nan")
    return [("aligned", aligned), ("long_first", long_first), ("head", head), ("tail", tail),
            ("padded", padded), ("only_inf", only_inf)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_logit_propagates_everywhere(kernels, device, dtype):
    for name, logits in _nan_cases(dtype, device):
        targets = torch.zeros(2, dtype=torch.long, device=device)
        for with_entropy in (False, True):
            out = token_logprob(logits, targets, return_entropy=with_entropy)
            logp, ent = out if with_entropy else (out, None)
            assert torch.isnan(logp[1]), f"{name} ({dtype}, {device}): row with a NaN logit gave {logp[1].item()}"
            want_logp, want_ent = _float64_logp_entropy(logits, targets)
            torch.testing.assert_close(logp[0].double().cpu(), want_logp[0], **TOL[torch.float32], msg=name)
            if with_entropy:
                assert torch.isnan(ent[1]), f"{name}: entropy {ent.tolist()}"
                torch.testing.assert_close(ent[0].double().cpu(), want_ent[0], **TOL[torch.float32], msg=name)
