"""kl_penalty, kl_penalty_masked_mean and policy_loss: kernels and the pure-torch references each
against a float64 oracle (forward, gradients, statistics), references vs hand-worked numbers, fp64
gradcheck, opcheck, edge shapes and bad input."""
import importlib
import math

import pytest
import torch
from conftest import TOL, assert_close_to_oracle, requires_cuda

from megalign.ops.common import KINDS as KL_KINDS
from megalign.ops.kl_penalty import kl_penalty, kl_penalty_masked_mean
from megalign.ops.policy_loss import PolicyLossStats, policy_loss

# The reference modules by name: megalign.ops.reference re-exports functions with the same names.
ref_kl = importlib.import_module("megalign.ops.reference.kl_penalty")
ref_pl = importlib.import_module("megalign.ops.reference.policy_loss")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
KINDS = KL_KINDS
SHAPES = [(0,), (1,), (3, 7), (5, 0), (2, 3, 11), (4, 257)]


def make(shape, dtype, scale=1.0, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def policy_inputs(shape, dtype, seed=0, device="cpu"):
    logp = make(shape, dtype, 0.5, seed, device) - 1.0
    old = logp.double().add(make(shape, torch.float64, 0.3, seed + 1, device)).to(dtype)
    adv = make(shape, dtype, 1.0, seed + 2, device)
    ref = logp.double().add(make(shape, torch.float64, 0.3, seed + 3, device)).to(dtype)
    mask = make(shape, torch.float64, 1.0, seed + 4, device) > -0.8
    return logp, old, adv, ref, mask


def check_vs_oracle(name, got, oracle, eager, dtype, scale=None):
    """got against the float64 oracle: TOL for fp64 inputs, else the oracle rule (conftest) with
    eager = the reference math run in fp32 (compute_dtype), plain torch's own error."""
    if dtype == torch.float64:
        torch.testing.assert_close(got, oracle, **TOL[torch.float64], msg=lambda m: f"{name}: {m}")
    else:
        assert_close_to_oracle(got, oracle, eager, scale=scale, name=name)


def compare_stats(got: PolicyLossStats, want: PolicyLossStats, tol):
    for name, a, b in zip(PolicyLossStats._fields, got, want):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, **tol, msg=name)


# ---- references against hand-worked numbers -------------------------------------------------------

def test_reference_k3_hand_numbers():
    # ref - logp = ln 2: e^d - d - 1 = 2 - ln 2 - 1
    logp = torch.tensor([0.0, 0.3], dtype=torch.float64)
    ref = logp + math.log(2.0)
    torch.testing.assert_close(ref_kl.kl_penalty(logp, ref, "k3"), torch.full((2,), 1.0 - math.log(2.0), dtype=torch.float64))
    d = torch.linspace(-5, 5, 101, dtype=torch.float64)
    k3 = ref_kl.kl_penalty(torch.zeros_like(d), d, "k3")
    assert (k3[d != 0] > 0).all() and k3[d == 0].eq(0).all()
    torch.testing.assert_close(ref_kl.kl_penalty(torch.tensor([0.5]), torch.tensor([0.25]), "k1"), torch.tensor([0.25]))
    torch.testing.assert_close(ref_kl.kl_penalty(torch.tensor([0.5]), torch.tensor([0.25]), "k2"), torch.tensor([0.03125]))
    torch.testing.assert_close(ref_kl.kl_penalty(torch.tensor([0.25]), torch.tensor([0.5]), "abs"), torch.tensor([0.25]))
    # low_var_kl: d = 30 is clamped to 20 and the estimate to 10
    torch.testing.assert_close(ref_kl.kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "low_var_kl"), torch.tensor([10.0]))


def test_reference_policy_hand_numbers():
    one = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    mask = torch.tensor([True])
    # ratio 1.5, eps 0.2, A = +1: max(-1.5, -1.2) = -1.2, the clipped branch
    loss, st = ref_pl.policy_loss(one(math.log(1.5)), one(0.0), one(1.0), mask, 0.2)
    torch.testing.assert_close(loss, one(-1.2))
    assert st.clip_frac.item() == 1.0
    # ratio 0.5, A = -1: max(0.5, 0.8) = 0.8, clipped by eps_low
    loss, st = ref_pl.policy_loss(one(math.log(0.5)), one(0.0), one(-1.0), mask, 0.2)
    torch.testing.assert_close(loss, one(0.8))
    assert st.clip_frac.item() == 1.0
    # dual clip c = 3, A = -1, ratio 5: max(5, 1.2) = 5 -> min(5, 3) = 3
    loss, st = ref_pl.policy_loss(one(math.log(5.0)), one(0.0), one(-1.0), mask, 0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, one(3.0))
    assert st.dual_clip_frac.item() == 1.0 and st.clip_frac.item() == 0.0
    # clip-higher: ratio 1.25 with eps_high 0.28 stays unclipped (A = +1)
    loss, st = ref_pl.policy_loss(one(math.log(1.25)), one(0.0), one(1.0), mask, 0.2, 0.28)
    torch.testing.assert_close(loss, one(-1.25))
    assert st.clip_frac.item() == 0.0
    # beta * k3 with ref - logp = ln 2
    loss, st = ref_pl.policy_loss(one(0.0), one(0.0), one(0.0), mask, 0.2, beta=0.5, ref_logp=one(math.log(2.0)))
    torch.testing.assert_close(loss, one(0.5 * (1.0 - math.log(2.0))))
    torch.testing.assert_close(st.kl_mean.double(), one(1.0 - math.log(2.0))[0], atol=1e-6, rtol=1e-6)


HAND_CASES = [  # (ratio, A, eps_low, eps_high, dual_clip, loss, clipped, dual)
    (1.5, 1.0, 0.2, None, None, -1.2, 1.0, 0.0),
    (0.5, -1.0, 0.2, None, None, 0.8, 1.0, 0.0),
    (5.0, -1.0, 0.2, None, 3.0, 3.0, 0.0, 1.0),
    (1.25, 1.0, 0.2, 0.28, None, -1.25, 0.0, 0.0),
    (1.5, 1.0, 0.2, 0.28, None, -1.28, 1.0, 0.0),
]


@pytest.mark.parametrize("case", HAND_CASES)
def test_kernel_policy_hand_numbers(kernels, case):
    ratio, adv, lo, hi, c, want, clipped, dual = case
    logp = torch.tensor([math.log(ratio)], requires_grad=True)
    loss, st = policy_loss(logp, torch.zeros(1), torch.tensor([adv]), torch.ones(1, dtype=torch.bool), lo, hi, c)
    torch.testing.assert_close(loss, torch.tensor([want]))
    assert (st.clip_frac.item(), st.dual_clip_frac.item()) == (clipped, dual)
    loss.sum().backward()
    # The clipped and dual-clipped branches are constant in logp.
    want_grad = 0.0 if clipped or dual else -adv * ratio
    torch.testing.assert_close(logp.grad, torch.tensor([want_grad]))


def test_kernel_k3_nonnegative(kernels):
    d = torch.cat([torch.linspace(-30, 30, 2001), torch.tensor([1e-3, -1e-3, 1e-2, -1e-2])])
    for dtype in (torch.float32, torch.float64):
        k3 = kl_penalty(torch.zeros(d.shape, dtype=dtype), d.to(dtype), "k3")
        assert (k3 >= 0).all()
        assert (k3[d != 0] > 0).all() and (k3[d == 0] == 0).all()
    two = kl_penalty(torch.zeros(1, dtype=torch.float64), torch.tensor([math.log(2.0)], dtype=torch.float64), "k3")
    torch.testing.assert_close(two, torch.tensor([1.0 - math.log(2.0)], dtype=torch.float64), **TOL[torch.float64])


# ---- kl_penalty kernel vs reference -----------------------------------------------------------------

def kl_run(fn, logp, ref, kind, upstream, dtype=None, **kw):
    """(kl, d/d logp, d/d ref) of fn on fresh leaves cast to dtype (default: their own)."""
    a, b = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (logp, ref))
    out = fn(a, b, kind, **kw)
    return (out.detach(), *torch.autograd.grad(out, (a, b), upstream.to(out.dtype)))


def check_kl(logp, ref, kind, upstream, dtype):
    """kl_penalty's kernel and reference, values and both gradients, against the float64 oracle."""
    got = kl_run(kl_penalty, logp, ref, kind, upstream)
    assert got[0].dtype == ref_kl.acc_dtype(dtype) and got[0].shape == logp.shape
    assert got[1].dtype == got[2].dtype == dtype
    oracle = kl_run(ref_kl.kl_penalty, logp, ref, kind, upstream, torch.float64)
    eager = kl_run(ref_kl.kl_penalty, logp, ref, kind, upstream, compute_dtype=torch.float32)
    for name, result in (("kernel", got), ("reference", kl_run(ref_kl.kl_penalty, logp, ref, kind, upstream))):
        for what, a, o, t in zip(("kl", "d/d logp", "d/d ref_logp"), result, oracle, eager):
            check_vs_oracle(f"{name} {kind} {what}", a, o, t, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kl_penalty_matches_reference(kernels, kind, dtype, shape):
    check_kl(make(shape, dtype, 2.0, 0), make(shape, dtype, 2.0, 1), kind,
             make(shape, ref_kl.acc_dtype(dtype), 1.0, 5), dtype)


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_kl_small_log_ratios(kernels, kind):
    # A policy close to its reference: |d| = |ref - logp| from 1e-7 to 1e-2, where k3 ~ d^2 / 2 and
    # expm1(d) - d in fp32 cancels; checked per decade of |d| so that small values count too.
    logp = make((8, 1000), torch.float32, 0.5, 0) - 1.0
    sign = torch.sign(make((8, 1000), torch.float64, 1.0, 1))
    d = torch.logspace(-7, -2, 8000, dtype=torch.float64).reshape(8, 1000) * sign
    ref = (logp.double() + d).float()
    upstream = torch.ones(logp.shape)
    got = kl_run(kl_penalty, logp, ref, kind, upstream)
    reference = kl_run(ref_kl.kl_penalty, logp, ref, kind, upstream)
    oracle = kl_run(ref_kl.kl_penalty, logp, ref, kind, upstream, torch.float64)
    eager = kl_run(ref_kl.kl_penalty, logp, ref, kind, upstream, compute_dtype=torch.float32)
    exact_d = (ref.double() - logp.double()).abs()
    for lo in (1e-7, 1e-6, 1e-5, 1e-4, 1e-3):
        sel = (exact_d >= lo) & (exact_d < 10 * lo)
        for name, result in (("kernel", got), ("reference", reference)):
            for what, a, o, t in zip(("kl", "d/d logp"), result, oracle, eager):
                where = f"|d| in [{lo:g}, {10 * lo:g})"
                assert_close_to_oracle(a[sel], o[sel], t[sel], name=f"{name} {kind} {what}, {where}")
    assert (got[0][exact_d > 0] > 0).all() and (got[0][exact_d == 0] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_kl_penalty_extremes(kernels, kind):
    logp = torch.tensor([0.0, 0.0, -50.0, 50.0, -1e4, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([50.0, -50.0, 0.0, 0.0, 0.0, 15.0], dtype=torch.float64, requires_grad=True)
    out = kl_penalty(logp, ref, kind)
    want = ref_kl.kl_penalty(logp, ref, kind)
    torch.testing.assert_close(out, want, **TOL[torch.float64])
    torch.testing.assert_close(torch.autograd.grad(out.sum(), logp)[0], torch.autograd.grad(want.sum(), logp)[0])


def test_kl_penalty_noncontiguous_and_aliases(kernels):
    base = make((6, 40), torch.float32, 1.0, 0)
    logp = base[:, 1::3].requires_grad_()
    ref = make((40, 6), torch.float32, 1.0, 1).t()[:, 1::3]
    out = kl_penalty(logp, ref, "mse")
    torch.testing.assert_close(out, ref_kl.kl_penalty(logp, ref, "k2"))
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), logp - ref)
    (g,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(g, (logp - ref).detach())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64, torch.bfloat16])
def test_kl_masked_mean_matches_reference(kernels, kind, dtype, mask_dtype):
    shape = (5, 33)
    logp, ref = make(shape, dtype, 1.0, 0), make(shape, dtype, 1.0, 1)
    mask = (make(shape, torch.float64, 1.0, 2) > 0).to(mask_dtype)
    mask[2] = 0  # an all-masked row

    def kernel_mean(a, b, kind):
        return kl_penalty_masked_mean(a, b, mask, kind)

    def reference_mean(a, b, kind, **kw):
        return ref_kl.kl_penalty_masked_mean(a, b, mask, kind, **kw)

    one = torch.ones(())
    got = kl_run(kernel_mean, logp, ref, kind, one)
    assert got[0].dtype == ref_kl.acc_dtype(dtype) and got[0].shape == ()
    assert (got[1][2] == 0).all() and (got[2][2] == 0).all()
    oracle = kl_run(reference_mean, logp, ref, kind, one, torch.float64)
    eager = kl_run(reference_mean, logp, ref, kind, one, compute_dtype=torch.float32)
    # The mean's terms may cancel (k1): its floor is relative to the mean of |kl| over valid tokens.
    terms = ref_kl.kl_penalty(logp.double(), ref.double(), kind).abs()[mask != 0]
    for name, result in (("kernel", got), ("reference", kl_run(reference_mean, logp, ref, kind, one))):
        for what, a, o, t in zip(("mean", "d/d logp", "d/d ref_logp"), result, oracle, eager):
            scale = terms.mean().item() if what == "mean" else None
            check_vs_oracle(f"{name} {kind} {what}", a, o, t, dtype, scale=scale)


@pytest.mark.parametrize("shape", [(0,), (3, 4)])
def test_kl_masked_mean_all_masked_is_zero(kernels, shape):
    logp = make(shape, torch.float32, 1.0, 0).requires_grad_()
    out = kl_penalty_masked_mean(logp, make(shape, torch.float32, 1.0, 1), torch.zeros(shape, dtype=torch.bool))
    assert out.item() == 0.0
    (g,) = torch.autograd.grad(out, logp)
    assert (g == 0).all()


# ---- policy_loss kernel vs reference ----------------------------------------------------------------

POLICY_CONFIGS = [  # (eps_low, eps_high, dual_clip, beta, with_ref)
    (0.2, None, None, 0.0, False),
    (0.2, 0.28, 3.0, 0.0, True),
    (0.2, 0.28, 3.0, 0.04, True),
    (0.1, 0.3, None, 0.5, True),
]


def check_policy(logp, old, adv, mask, ref, cfg, dtype):
    """policy_loss's kernel and reference (loss, d/d logp, statistics) against the float64 oracle."""
    lo, hi, c, beta, with_ref = cfg
    ref = ref if with_ref else None
    upstream = make(logp.shape, ref_kl.acc_dtype(dtype), 1.0, 9, logp.device)

    def run(fn, cast=None, **kw):
        lp = logp.detach().to(cast or dtype).requires_grad_()
        old_, adv_, ref_ = (None if t is None else t.to(cast or dtype) for t in (old, adv, ref))
        loss, st = fn(lp, old_, adv_, mask, lo, hi, c, beta, ref_, **kw)
        (grad,) = torch.autograd.grad(loss, lp, upstream.to(loss.dtype))
        return loss.detach(), grad, st

    got = run(policy_loss)
    assert got[0].dtype == ref_kl.acc_dtype(dtype) and got[0].shape == logp.shape and got[1].dtype == dtype
    valid = mask != 0
    assert (got[0][~valid] == 0).all() and (got[1][~valid] == 0).all()
    oracle = run(ref_pl.policy_loss, torch.float64)
    eager = run(ref_pl.policy_loss, compute_dtype=torch.float32)
    for name, (loss, grad, st) in (("kernel", got), ("reference", run(ref_pl.policy_loss))):
        check_vs_oracle(f"{name} loss", loss, oracle[0], eager[0], dtype)
        check_vs_oracle(f"{name} d/d logp", grad, oracle[1], eager[1], dtype)
        compare_stats(st, oracle[2], dict(atol=1e-5, rtol=1e-5))


@pytest.mark.parametrize("cfg", POLICY_CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_policy_loss_matches_reference(kernels, cfg, dtype, shape):
    logp, old, adv, ref, mask = policy_inputs(shape, dtype)
    check_policy(logp, old, adv, mask, ref, cfg, dtype)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32,
                                        torch.float64, torch.bfloat16, torch.float16])
def test_policy_loss_mask_dtypes(kernels, mask_dtype):
    logp, old, adv, ref, mask = policy_inputs((3, 50), torch.float32, seed=3)
    check_policy(logp, old, adv, mask.to(mask_dtype), ref, POLICY_CONFIGS[2], torch.float32)


# Mask elements at the edges of "nonzero" for each dtype: 64-bit integers nonzero in one 32-bit half
# only, -0.0 (zero), NaN, infinities and subnormals (nonzero). The vector kernels test 64-bit masks
# on their 32-bit halves and widen byte masks in steps, so a lane that reads the wrong half or byte
# shows up here as a token counted or dropped.
EDGE_MASK_VALUES = {
    torch.bool: [False, True],
    torch.uint8: [0, 1, 128, 255],
    torch.int32: [0, 1, -1, 2**31 - 1, -2**31, 65536],
    torch.int64: [0, 1, -1, 2**32, -2**32, 2**40, 2**63 - 1, -2**63, 2**31],
    torch.float32: [0.0, -0.0, 1e-45, 1e-40, math.nan, -math.inf, 2.0],
    torch.float64: [0.0, -0.0, 5e-324, 1e-310, math.nan, math.inf, -3.5, 2.0**-1074 * 2**33],
    torch.bfloat16: [0.0, -0.0, 1e-40, math.nan, -1.0],
    torch.float16: [0.0, -0.0, 6e-8, math.nan, -math.inf, 1.0],
}


def edge_mask(shape, mask_dtype, seed=5):
    """A mask of `shape` whose elements are drawn at random from EDGE_MASK_VALUES[mask_dtype]."""
    values = torch.tensor(EDGE_MASK_VALUES[mask_dtype], dtype=mask_dtype)
    g = torch.Generator().manual_seed(seed)
    return values[torch.randint(len(values), shape, generator=g)]


@pytest.mark.parametrize("mask_dtype", list(EDGE_MASK_VALUES))
def test_masks_valid_where_nonzero(kernels, mask_dtype):
    shape = (3, 70)  # full vectors and a partial one at every vector width
    mask = edge_mask(shape, mask_dtype)
    valid = mask != 0
    assert valid.any() and not valid.all()
    logp, ref = make(shape, torch.float32, 1.0, 0), make(shape, torch.float32, 1.0, 1)
    lp = logp.clone().requires_grad_()
    mean = kl_penalty_masked_mean(lp, ref, mask, "k3")
    (grad,) = torch.autograd.grad(mean, lp)
    torch.testing.assert_close(mean, ref_kl.kl_penalty_masked_mean(logp, ref, valid, "k3"))
    assert torch.equal(grad != 0, valid)
    logp, old, adv, ref, _ = policy_inputs(shape, torch.float32, seed=6)
    check_policy(logp, old, adv, mask, ref, POLICY_CONFIGS[2], torch.float32)


def test_policy_loss_noncontiguous(kernels):
    logp, old, adv, ref, mask = policy_inputs((6, 64), torch.float32, seed=4)
    sl = (slice(None), slice(1, None, 2))
    adv_t = adv.t().contiguous().t()  # column-major
    check_policy(logp[sl], old[sl], adv_t[sl], mask[sl], ref[sl], POLICY_CONFIGS[2], torch.float32)


def test_policy_loss_extreme_log_ratios(kernels):
    # logp - old_logp = +-50 hits the +-20 clamp: ratio e^+-20, zero gradient through the clamp.
    logp = torch.tensor([[50.0, -50.0, 50.0, -50.0, 0.1]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(logp, dtype=torch.bool)
    for cfg in POLICY_CONFIGS:
        check_policy(logp, old, adv, mask, logp + 0.5, cfg, torch.float64)
    _, st = policy_loss(logp, old, adv, mask)
    torch.testing.assert_close(st.ratio_max, torch.tensor(math.exp(20.0)))
    torch.testing.assert_close(st.ratio_min, torch.tensor(math.exp(-20.0)))


def test_policy_loss_all_masked_defaults(kernels):
    for shape in [(0,), (2, 0), (3, 5)]:
        logp, old, adv, ref, _ = policy_inputs(shape, torch.float32)
        mask = torch.zeros(shape, dtype=torch.bool)
        loss, st = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref)
        _, want = ref_pl.policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref)
        assert (loss == 0).all()
        assert [v.item() for v in st] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
        compare_stats(st, want, dict(atol=0, rtol=0))


def test_policy_loss_all_masked_row(kernels):
    logp, old, adv, ref, mask = policy_inputs((4, 31), torch.float32, seed=5)
    mask[1] = False
    check_policy(logp, old, adv, mask, ref, POLICY_CONFIGS[2], torch.float32)


def reduce_loss(loss, stats, reduction):
    """The per-token loss reduced as policy_loss's `reduction` defines it (module doc)."""
    total = loss.sum()
    return total if reduction == "sum" else total / stats.count.clamp(min=1).to(total.dtype)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["dense", "strided", "empty", "all_masked"])
def test_policy_loss_reductions(kernels, reduction, dtype, layout):
    """reduction="sum" / "mean" (the CPU kernels sum in the pass, no per-token loss stored) against the
    float64 oracle's per-token loss reduced the same way: value, d/d logp for an upstream gradient that
    is not 1, statistics; the recompute path (a second backward) gives the same gradient."""
    shape = {"dense": (5, 300), "strided": (6, 130), "empty": (0, 4), "all_masked": (3, 20)}[layout]
    logp, old, adv, ref, mask = policy_inputs(shape, dtype, seed=11)
    if layout == "strided":
        logp, old, adv, ref, mask = (t[:, 1::2] for t in (logp, old, adv, ref, mask))
    if layout == "all_masked":
        mask = torch.zeros_like(mask)
    cfg = (0.2, 0.28, 3.0, 0.04)

    def run(fn, cast=None, reduced=True, twice=False, **kw):
        lp = logp.detach().to(cast or dtype).requires_grad_()
        old_, adv_, ref_ = (t.to(cast or dtype) for t in (old, adv, ref))
        if reduced:
            loss, st = fn(lp, old_, adv_, mask, *cfg, ref_, reduction=reduction)
        else:
            per_token, st = fn(lp, old_, adv_, mask, *cfg, ref_, **kw)
            loss = reduce_loss(per_token, st, reduction)
        upstream = torch.tensor(0.7, dtype=loss.dtype)
        (grad,) = torch.autograd.grad(loss, lp, upstream, retain_graph=twice)
        if twice:
            (again,) = torch.autograd.grad(loss, lp, upstream)
            torch.testing.assert_close(again, grad, **TOL[dtype])
        return loss.detach(), grad, st

    got = run(policy_loss, twice=True)
    assert got[0].shape == () and got[0].dtype == ref_kl.acc_dtype(dtype) and got[1].dtype == dtype
    oracle = run(ref_pl.policy_loss, torch.float64, reduced=False)
    eager = run(ref_pl.policy_loss, reduced=False, compute_dtype=torch.float32)
    per_token, _ = ref_pl.policy_loss(*(t.double() for t in (logp, old, adv)), mask, *cfg, ref.double())
    magnitude = per_token.abs().sum().item() / (1 if reduction == "sum" else max(int((mask != 0).sum()), 1))
    check_vs_oracle("reduced loss", got[0], oracle[0], eager[0], dtype, scale=magnitude or None)
    check_vs_oracle("d/d logp", got[1], oracle[1], eager[1], dtype)
    compare_stats(got[2], oracle[2], dict(atol=1e-5, rtol=1e-5))
    if layout in ("all_masked", "empty"):
        assert got[0].item() == 0 and (got[1] == 0).all()


def test_policy_loss_bad_reduction():
    logp, old, adv, ref, mask = policy_inputs((2, 3), torch.float32)
    with pytest.raises(ValueError, match="reduction must be one of none, sum, mean, got 'token-mean'"):
        policy_loss(logp, old, adv, mask, reduction="token-mean")


def test_policy_loss_constant_inputs_get_no_grad(kernels):
    logp, old, adv, ref, mask = policy_inputs((2, 9), torch.float32)
    logp.requires_grad_()
    old.requires_grad_()
    adv.requires_grad_()
    ref.requires_grad_()
    loss, st = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref)
    loss.sum().backward()
    assert logp.grad is not None and old.grad is None and adv.grad is None and ref.grad is None
    assert not st.count.requires_grad


def test_reference_path_matches_kernels(monkeypatch):
    logp, old, adv, ref, mask = policy_inputs((3, 17), torch.float32)
    monkeypatch.setenv("MEGALIGN_OPS", "reference")
    want, want_st = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref)
    want_kl = kl_penalty_masked_mean(logp, ref, mask, "low_var_kl")
    monkeypatch.setenv("MEGALIGN_OPS", "auto")
    got, got_st = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref)
    torch.testing.assert_close(got, want)
    compare_stats(got_st, want_st, dict(atol=1e-6, rtol=1e-6))
    torch.testing.assert_close(kl_penalty_masked_mean(logp, ref, mask, "low_var_kl"), want_kl)


# ---- the gradient written by the forward (with_dlogp) ----------------------------------------------

def dlogp_operands(dtype, strided):
    """(logp, ref, old, adv, mask) of shape (4, 257): contiguous (vector kernels for fp32 / bf16 /
    fp16) or every other column of a wider tensor (the scalar loops), an all-masked row included."""
    width = 514 if strided else 257
    logp, old, adv, ref, mask = policy_inputs((4, width), dtype, seed=11)
    mask[1] = False
    cols = slice(None, None, 2) if strided else slice(None)
    return tuple(t[:, cols] for t in (logp, ref, old, adv, mask))


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_kl_forward_dlogp_is_the_unit_gradient(kernels, kind, dtype, strided):
    # The forward's dlogp (acc dtype) is the backward kernel's gradient for an upstream gradient of
    # 1 (and, for the masked mean, of count, so grad_mean / count = 1), up to the last bit (FMA
    # contraction may differ between the two loops), and the float64 oracle's d kl / d logp within
    # the oracle rule.
    logp, ref, _, _, mask = dlogp_operands(dtype, strided)
    ops = torch.ops.megalign
    acc = ref_kl.acc_dtype(dtype)
    kl, dlogp = ops.kl_penalty_fwd(logp, ref, kind, True)
    assert dlogp.dtype == acc and dlogp.shape == logp.shape
    torch.testing.assert_close(kl, ops.kl_penalty_fwd(logp, ref, kind)[0])
    ones = torch.ones(logp.shape, dtype=acc)
    torch.testing.assert_close(dlogp.to(dtype), ops.kl_penalty_bwd(ones, logp, ref, kind))
    oracle = kl_run(ref_kl.kl_penalty, logp, ref, kind, ones, torch.float64)[1]
    eager = kl_run(ref_kl.kl_penalty, logp, ref, kind, ones, compute_dtype=torch.float32)[1]
    check_vs_oracle(f"{kind} forward dlogp", dlogp, oracle, eager, acc)

    mean, count, masked = ops.kl_masked_mean_fwd(logp, ref, mask, kind, True)
    torch.testing.assert_close(mean, ops.kl_masked_mean_fwd(logp, ref, mask, kind)[0])
    assert masked.dtype == acc and (masked[1] == 0).all()
    unit = ops.kl_masked_mean_bwd(count.to(acc), count, logp, ref, mask, kind)
    torch.testing.assert_close(masked.to(dtype), unit)
    torch.testing.assert_close(masked, torch.where(mask, dlogp, 0.0))


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", POLICY_CONFIGS)
def test_policy_forward_dlogp_is_the_unit_gradient(kernels, cfg, dtype, strided):
    logp, ref, old, adv, mask = dlogp_operands(dtype, strided)
    lo, hi, c, beta, with_ref = cfg
    hi = lo if hi is None else hi
    args = (logp, old, adv, mask, lo, hi, c, beta, ref if with_ref else None)
    ops = torch.ops.megalign
    acc = ref_kl.acc_dtype(dtype)
    loss, stats, dlogp = ops.policy_loss_fwd(*args, True)
    plain = ops.policy_loss_fwd(*args)
    assert plain[2].numel() == 0 and dlogp.dtype == acc and dlogp.shape == logp.shape
    torch.testing.assert_close(loss, plain[0])
    torch.testing.assert_close(stats, plain[1])
    unit = ops.policy_loss_bwd(torch.ones(logp.shape, dtype=acc), *args)
    torch.testing.assert_close(dlogp.to(dtype), unit)
    assert (dlogp[~mask] == 0).all()

    def unit_grad(cast, **kw):
        lp = logp.detach().to(cast).requires_grad_()
        loss, _ = ref_pl.policy_loss(lp, old.to(cast), adv.to(cast), mask, lo, hi, c, beta,
                                     ref.to(cast) if with_ref else None, **kw)
        return torch.autograd.grad(loss.sum(), lp)[0]

    eager = unit_grad(dtype, compute_dtype=torch.float32)
    check_vs_oracle("policy forward dlogp", dlogp, unit_grad(torch.float64), eager, acc)


def test_dlogp_only_when_the_cpu_kernels_need_a_gradient(kernels):
    from megalign.ops.kl_penalty import wants_dlogp

    x = torch.zeros(3)
    assert not wants_dlogp(x, x)
    assert wants_dlogp(x, x.clone().requires_grad_())
    assert wants_dlogp(x.clone().double().requires_grad_())
    assert not wants_dlogp(x.bfloat16().requires_grad_())  # its gradient dtype is not the buffer's
    with torch.no_grad():
        assert not wants_dlogp(x.clone().requires_grad_())


def test_retained_graph_backward_twice(kernels):
    # The first backward scales the forward's dlogp in place, the second recomputes it with the
    # backward kernel: both give the float64 reference's gradients, for logp and ref_logp alike.
    logp, old, adv, ref, mask = policy_inputs((3, 37), torch.float32, seed=3)
    weights = make(logp.shape, torch.float32, 1.0, 4)

    def cases(kl, masked_mean, policy):
        return {
            "kl_penalty": lambda a, b: (kl(a, b, "low_var_kl") * weights.to(a.dtype)).sum(),
            "masked_mean": lambda a, b: masked_mean(a, b, mask, "k3"),
            "policy_loss": lambda a, b: policy(a, old.to(a.dtype), adv.to(a.dtype), mask, 0.2, 0.28, 3.0, 0.1,
                                               b.detach())[0].sum(),
        }

    kernel_cases = cases(kl_penalty, kl_penalty_masked_mean, policy_loss)
    oracle_cases = cases(ref_kl.kl_penalty, ref_kl.kl_penalty_masked_mean, ref_pl.policy_loss)
    for name, fn in kernel_cases.items():
        oracle_fn = oracle_cases[name]
        a, b = logp.clone().requires_grad_(), ref.clone().requires_grad_()
        out = fn(a, b)
        first = torch.autograd.grad(out, (a, b), retain_graph=True, allow_unused=True)
        second = torch.autograd.grad(out, (a, b), allow_unused=True)
        a64, b64 = logp.double().requires_grad_(), ref.double().requires_grad_()
        want = torch.autograd.grad(oracle_fn(a64, b64), (a64, b64), allow_unused=True)
        for got, w, which in zip(zip(first, second), want, ("logp", "ref_logp")):
            if w is None:
                assert got == (None, None), f"{name} d/d {which}"
                continue
            torch.testing.assert_close(got[0], got[1], msg=f"{name} d/d {which}")
            torch.testing.assert_close(got[0].double(), w, atol=1e-5, rtol=1e-5, msg=f"{name} d/d {which}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strided", [False, True])
def test_scalar_upstream_gradients(kernels, dtype, strided):
    # One upstream value for every token (a masked mean's 0-d gradient; a sum's, expanded with
    # stride 0) takes the backward's one pass over the forward's dlogp, writing d/d logp in place
    # and d/d ref_logp beside it: both against the float64 oracle, scale != 1, and an all-masked
    # mean (count 0: zero gradients, not 0 / 0).
    logp, old, adv, ref, mask = policy_inputs((6, 301) if not strided else (301, 6), dtype, seed=7)
    if strided:
        logp, old, adv, ref, mask = (t.t() for t in (logp, old, adv, ref, mask))
    cases = {
        "kl_penalty sum": lambda kl, mm, pl, a, b, m: kl(a, b, "low_var_kl").sum() * -2.5,
        "masked_mean": lambda kl, mm, pl, a, b, m: mm(a, b, m, "k3") * 0.75,
        "masked_mean, none valid": lambda kl, mm, pl, a, b, m: mm(a, b, torch.zeros_like(m), "k3") * 3.0,
        "policy_loss sum": lambda kl, mm, pl, a, b, m: pl(a, old.to(a.dtype), adv.to(a.dtype), m, 0.2, 0.28, 3.0,
                                                          0.1, b.detach())[0].sum() * 1.5,
    }
    for name, fn in cases.items():
        a, b = logp.clone().requires_grad_(), ref.clone().requires_grad_()
        got = torch.autograd.grad(fn(kl_penalty, kl_penalty_masked_mean, policy_loss, a, b, mask), (a, b),
                                  allow_unused=True)
        a64, b64 = logp.double().requires_grad_(), ref.double().requires_grad_()
        want = torch.autograd.grad(fn(ref_kl.kl_penalty, ref_kl.kl_penalty_masked_mean, ref_pl.policy_loss,
                                      a64, b64, mask), (a64, b64), allow_unused=True)
        for g, w, which in zip(got, want, ("logp", "ref_logp")):
            if w is None:
                assert g is None, f"{name} d/d {which}"
                continue
            assert g.dtype == dtype and g.shape == logp.shape, f"{name} d/d {which}"
            tol = TOL[torch.float64] if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(g.double(), w, **tol, msg=lambda m: f"{name} d/d {which}: {m}")
        if name.startswith("masked_mean"):
            torch.testing.assert_close(got[1], -got[0], rtol=0, atol=0)


# ---- gradcheck and opcheck --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_kl_gradcheck(kernels, kind):
    logp = make((3, 5), torch.float64, 1.0, 0).requires_grad_()
    ref = make((3, 5), torch.float64, 1.0, 1).requires_grad_()
    mask = make((3, 5), torch.float64, 1.0, 2) > 0
    assert torch.autograd.gradcheck(lambda a, b: kl_penalty(a, b, kind), (logp, ref))
    assert torch.autograd.gradcheck(lambda a, b: kl_penalty_masked_mean(a, b, mask, kind), (logp, ref))


@pytest.mark.parametrize("cfg", POLICY_CONFIGS)
def test_policy_gradcheck(kernels, cfg):
    logp, old, adv, ref, mask = policy_inputs((3, 6), torch.float64, seed=7)
    lo, hi, c, beta, with_ref = cfg
    for reduction in ("none", "mean"):
        fn = lambda x: policy_loss(x, old, adv, mask, lo, hi, c, beta, ref if with_ref else None,  # noqa: E731
                                   reduction=reduction)[0]
        assert torch.autograd.gradcheck(fn, (logp.detach().requires_grad_(),))


def test_opcheck(kernels):
    logp, old, adv, ref, mask = policy_inputs((3, 8), torch.float32)
    lp = logp.clone().requires_grad_()
    rf = ref.clone().requires_grad_()
    ops = torch.ops.megalign
    torch.library.opcheck(ops.kl_penalty_fwd, (lp, rf, "k3"))
    # with_dlogp: the dlogp output is autograd's buffer, which the first backward scales in place
    # into the gradient, so opcheck's eager-vs-AOT comparison of the outputs after a backward does
    # not apply to it (torch.compile multiplies out of place: scale_dlogp).
    dlogp_checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.kl_penalty_fwd, (lp, rf, "low_var_kl", True), test_utils=dlogp_checks)
    torch.library.opcheck(ops.kl_masked_mean_fwd, (lp, rf, mask, "k3", True), test_utils=dlogp_checks)
    torch.library.opcheck(ops.policy_loss_fwd, (lp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref, True),
                          test_utils=dlogp_checks)
    torch.library.opcheck(ops.kl_penalty_bwd, (torch.ones(3, 8), logp, ref, "low_var_kl"))
    torch.library.opcheck(ops.kl_masked_mean_fwd, (lp, rf, mask, "k2"))
    mean, count, _ = ops.kl_masked_mean_fwd(logp, ref, mask, "k2")
    torch.library.opcheck(ops.kl_masked_mean_bwd, (torch.ones(()), count, logp, ref, mask, "k2"))
    torch.library.opcheck(ops.policy_loss_fwd, (lp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref))
    torch.library.opcheck(ops.policy_loss_fwd, (lp, old, adv, mask, 0.2, 0.2, None, 0.0, None))
    torch.library.opcheck(ops.policy_loss_fwd, (lp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref, True, True),
                          test_utils=dlogp_checks)
    torch.library.opcheck(ops.policy_loss_fwd, (lp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref, False, True))
    torch.library.opcheck(ops.policy_loss_bwd, (torch.ones(3, 8), logp, old, adv, mask, 0.2, 0.28, 3.0, 0.1, ref))


# ---- bad input --------------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument(kernels):
    logp, old, adv, ref, mask = policy_inputs((2, 5), torch.float32)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, ref, "k4")
    with pytest.raises(ValueError, match="ref_logp"):
        kl_penalty(logp, ref[:, :4], "k3")
    with pytest.raises(TypeError, match="ref_logp"):
        kl_penalty(logp, ref.double())
    with pytest.raises(TypeError, match="logp"):
        kl_penalty(logp.long(), ref)
    with pytest.raises(ValueError, match="mask"):
        kl_penalty_masked_mean(logp, ref, mask[:1])
    with pytest.raises(TypeError, match="mask"):
        kl_penalty_masked_mean(logp, ref, mask.to(torch.int16))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:, :3], mask)
    with pytest.raises(TypeError, match="old_logp"):
        policy_loss(logp, old.half(), adv, mask)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(logp, old, adv, mask, eps_low=-0.1)
    with pytest.raises(ValueError, match="eps_high"):
        policy_loss(logp, old, adv, mask, eps_high=-0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="beta"):
        policy_loss(logp, old, adv, mask, beta=-1.0, ref_logp=ref)


def test_bad_inputs_at_the_op_level(kernels):
    logp, old, adv, ref, mask = policy_inputs((2, 5), torch.float32)
    ops = torch.ops.megalign
    with pytest.raises(RuntimeError, match="kind"):
        ops.kl_penalty_fwd(logp, ref, "nope")
    with pytest.raises(RuntimeError, match="ref_logp"):
        ops.kl_penalty_fwd(logp, ref.double(), "k3")
    with pytest.raises(RuntimeError, match="advantages"):
        ops.policy_loss_fwd(logp, old, adv[:1], mask, 0.2, 0.2, None, 0.0, None)
    with pytest.raises(RuntimeError, match="ref_logp"):
        ops.policy_loss_fwd(logp, old, adv, mask, 0.2, 0.2, None, 0.1, None)
    with pytest.raises(RuntimeError, match="dual_clip"):
        ops.policy_loss_fwd(logp, old, adv, mask, 0.2, 0.2, 0.5, 0.0, None)
    with pytest.raises(RuntimeError, match="mask"):
        ops.policy_loss_fwd(logp, old, adv, mask.to(torch.int16), 0.2, 0.2, None, 0.0, None)
    with pytest.raises(RuntimeError, match="grad"):
        ops.policy_loss_bwd(torch.ones(2, 5, dtype=torch.float64), logp, old, adv, mask, 0.2, 0.2, None, 0.0, None)


def test_stats_fields():
    assert PolicyLossStats._fields == ("count", "clip_frac", "dual_clip_frac", "approx_kl", "ratio_min",
                                       "ratio_max", "kl_mean")


# ---- CUDA -------------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 7), (64, 4099)])
def test_cuda_matches_cpu(kernels, dtype, shape):
    logp, old, adv, ref, mask = policy_inputs(shape, dtype)
    for cfg in POLICY_CONFIGS:
        check_policy(logp.cuda(), old.cuda(), adv.cuda(), mask.cuda(), ref.cuda(), cfg, dtype)
    for kind in KINDS:
        check_kl(logp.cuda(), ref.cuda(), kind, make(shape, ref_kl.acc_dtype(dtype), 1.0, 5, "cuda"), dtype)
        lp, rf, m = logp.cuda(), ref.cuda(), mask.cuda()
        terms = ref_kl.kl_penalty(lp.double(), rf.double(), kind).abs()[m]
        check_vs_oracle(f"cuda masked mean {kind}", kl_penalty_masked_mean(lp, rf, m, kind),
                        ref_kl.kl_penalty_masked_mean(lp.double(), rf.double(), m, kind),
                        ref_kl.kl_penalty_masked_mean(lp, rf, m, kind, compute_dtype=torch.float32), dtype,
                        scale=terms.mean().item() if terms.numel() else None)


@requires_cuda
def test_cuda_noncontiguous_and_expanded_grad(kernels):
    logp, old, adv, ref, mask = (t.cuda() for t in policy_inputs((8, 300), torch.float32))
    sl = (slice(None), slice(0, None, 3))
    check_policy(logp[sl], old[sl], adv[sl], mask[sl], ref[sl], POLICY_CONFIGS[2], torch.float32)
