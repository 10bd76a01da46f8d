"""megalign.ops.gae: kernel and the reversed-loop reference against a float64 oracle, hand-worked
numbers, skip rules."""
import pytest
import torch
from conftest import TOL, assert_close_to_oracle, requires_cuda

from megalign.ops.gae import gae, masked_reward_count
from megalign.ops.reference.gae import gae as reference_gae

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (0.0, 0.95), (0.99, 0.0)]


def _batch(B, T, dtype=torch.float32, seed=0):
    """Rows of every mask kind: dense, random holes, leading+trailing padding, all masked, one valid."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g).to(dtype)
    values = torch.randn(B, T, generator=g).to(dtype)
    mask = torch.rand(B, T, generator=g) < 0.7
    t = torch.arange(T)
    kinds = {0: torch.ones(T, dtype=torch.bool), 2: (t >= T // 5) & (t < T - T // 4) & (t % 7 != 3),
             3: torch.zeros(T, dtype=torch.bool), 4: t == T // 2}  # kind 1 keeps its random holes
    for b in range(B):
        if b % 5 in kinds:
            mask[b] = kinds[b % 5]
    return rewards, values, mask


def _check_vs_oracle(r, v, m, gamma, lam, got, name="kernel"):
    """got = (advantages, returns) of fp32/bf16/fp16 inputs against the reference run in float64
    (the oracle), by the oracle rule with the same recursion in fp32 as plain torch's own error."""
    oracle = reference_gae(r.double(), v.double(), m, gamma, lam)
    eager = reference_gae(r, v, m, gamma, lam, compute_dtype=torch.float32)
    for what, a, o, t in zip(("advantages", "returns"), got, oracle, eager):
        assert_close_to_oracle(a, o, t, name=f"{name} {what}")


def _hand_case():
    # r = [1, 5, 2, 3], V = [0.5, 9, 1, 2], mask = [1, 0, 1, 1], gamma = lam = 0.5 (gamma*lam = 0.25).
    r = torch.tensor([[1.0, 5.0, 2.0, 3.0]])
    v = torch.tensor([[0.5, 9.0, 1.0, 2.0]])
    m = torch.tensor([[True, False, True, True]])
    # t=3: A = 3 + 0.5*0 - 2 + 0.25*0 = 1;            R = 1 + 2 = 3
    # t=2: A = 2 + 0.5*2 - 1 + 0.25*1 = 2.25;         R = 3.25
    # t=1: masked -> 0, 0 (its reward 5 and value 9 are ignored)
    # t=0: next valid is t=2: A = 1 + 0.5*1 - 0.5 + 0.25*2.25 = 1.5625; R = 2.0625
    return r, v, m, torch.tensor([[1.5625, 0.0, 2.25, 1.0]]), torch.tensor([[2.0625, 0.0, 3.25, 3.0]])


def test_reference_hand_worked():
    r, v, m, want_a, want_r = _hand_case()
    a, ret = reference_gae(r, v, m, 0.5, 0.5)
    torch.testing.assert_close(a, want_a)
    torch.testing.assert_close(ret, want_r)


def test_kernel_hand_worked(kernels):
    r, v, m, want_a, want_r = _hand_case()
    a, ret = gae(r, v, m, 0.5, 0.5)
    torch.testing.assert_close(a, want_a)
    torch.testing.assert_close(ret, want_r)


def test_reference_matches_plain_gae_without_mask():
    # With every position valid, the skip rule is the textbook recursion; gamma = lam = 1 gives
    # A_t = sum_{k>=t} r_k - V_t (Monte-Carlo return minus value).
    r, v = torch.randn(3, 9, dtype=torch.float64), torch.randn(3, 9, dtype=torch.float64)
    a, ret = reference_gae(r, v, torch.ones(3, 9, dtype=torch.bool), 1.0, 1.0)
    mc = r.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(a, mc - v)
    torch.testing.assert_close(ret, mc)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
def test_kernel_vs_reference(kernels, dtype, gamma, lam):
    r, v, m = _batch(11, 203, dtype)
    a, ret = gae(r, v, m, gamma, lam)
    out = torch.float64 if dtype == torch.float64 else torch.float32
    assert a.dtype == ret.dtype == out and a.shape == ret.shape == r.shape
    if dtype == torch.float64:
        ra, rret = reference_gae(r, v, m, gamma, lam)
        torch.testing.assert_close(a, ra, **TOL[torch.float64])
        torch.testing.assert_close(ret, rret, **TOL[torch.float64])
    else:
        _check_vs_oracle(r, v, m, gamma, lam, (a, ret))
        _check_vs_oracle(r, v, m, gamma, lam, reference_gae(r, v, m, gamma, lam), "reference")
    assert (a[~m] == 0).all() and (ret[~m] == 0).all()
    assert (a[3] == 0).all()  # the all-masked row


@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (1, 7), (4, 1), (3, 0)])
def test_odd_shapes(kernels, shape):
    r, v = torch.randn(shape), torch.randn(shape)
    m = torch.rand(shape) < 0.6
    _check_vs_oracle(r, v, m, 0.9, 0.8, gae(r, v, m, 0.9, 0.8))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_long_rows(kernels, gamma, lam):
    # 17 x 32768 elements: above the CPU kernel's parallel grain, so rows run on several threads.
    r, v, m = _batch(17, 32768, torch.float64, seed=1)
    a, ret = gae(r, v, m, gamma, lam)
    ra, rret = reference_gae(r, v, m, gamma, lam)
    torch.testing.assert_close(a, ra, **TOL[torch.float64])
    torch.testing.assert_close(ret, rret, **TOL[torch.float64])
    r32, v32 = r.float(), v.float()
    _check_vs_oracle(r32, v32, m, gamma, lam, gae(r32, v32, m, gamma, lam))


def test_mask_kinds_and_ignored_masked_inputs(kernels):
    r, v, m = _batch(6, 40)
    a, ret = gae(r, v, m, 0.99, 0.95)
    for mask in (m.float(), m.to(torch.int64), m.to(torch.bfloat16)):
        a2, ret2 = gae(r, v, mask, 0.99, 0.95)
        assert torch.equal(a, a2) and torch.equal(ret, ret2)
    # Rewards and values at masked positions do not matter, even NaN/inf.
    r2 = r.masked_fill(~m, float("nan"))
    v2 = v.masked_fill(~m, float("inf"))
    a2, ret2 = gae(r2, v2, m, 0.99, 0.95)
    assert torch.equal(a, a2) and torch.equal(ret, ret2)
    assert masked_reward_count(r, m).item() == int((~m).sum())


def test_non_contiguous(kernels):
    r, v, m = _batch(5, 33)
    rt, vt, mt = r.t().contiguous().t(), v.t().contiguous().t(), m.t().contiguous().t()
    assert not rt.is_contiguous()
    _check_vs_oracle(r, v, m, 0.9, 0.7, gae(rt, vt, mt[:, :], 0.9, 0.7))
    sl = (slice(None), slice(None, None, 2))
    _check_vs_oracle(r[sl], v[sl], m[sl], 0.9, 0.7, gae(r[sl], v[sl], m[sl], 0.9, 0.7))


@pytest.mark.parametrize("path", ["kernels", "reference"])
def test_no_gradients(request, path):
    request.getfixturevalue(path)
    r, v, m = _batch(2, 6)
    a, ret = gae(r.requires_grad_(), v.requires_grad_(), m)
    assert not a.requires_grad and not ret.requires_grad


def test_bad_inputs():
    r, v, m = _batch(2, 6)
    with pytest.raises(ValueError, match="rewards"):
        gae(r[0], v[0], m[0])
    with pytest.raises(TypeError, match="rewards"):
        gae(r.long(), v.long(), m)
    with pytest.raises(ValueError, match="values"):
        gae(r, v[:, :5], m)
    with pytest.raises(TypeError, match="values"):
        gae(r, v.double(), m)
    with pytest.raises(ValueError, match="mask"):
        gae(r, v, m[:1])
    with pytest.raises(ValueError, match="gamma"):
        gae(r, v, m, gamma=float("nan"))
    with pytest.raises(ValueError, match="lam"):
        gae(r, v, m, lam=None)


def test_op_checks(kernels):
    r, v, m = _batch(2, 6)
    with pytest.raises(RuntimeError, match="mask must be Bool"):
        torch.ops.megalign.gae(r, v, m.float(), 1.0, 1.0)
    with pytest.raises(RuntimeError, match="values must have the dtype of rewards"):
        torch.ops.megalign.gae(r, v.half(), m, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="rewards must have 2 dimensions"):
        torch.ops.megalign.gae(r[0], v[0], m[0], 1.0, 1.0)


def test_opcheck(kernels):
    r, v, m = _batch(3, 17)
    torch.library.opcheck(torch.ops.megalign.gae.default, (r, v, m, 0.99, 0.95))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7, 2047, 2048, 2049, 5000, 32768])
def test_cuda_vs_reference(kernels, dtype, T):
    r, v, m = _batch(5, T, dtype)
    ra, rret = reference_gae(r, v, m, 0.99, 0.95)
    a, ret = gae(r.cuda(), v.cuda(), m.cuda(), 0.99, 0.95)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype != torch.float64 else TOL[torch.float64]
    torch.testing.assert_close(a.cpu(), ra, **tol)
    torch.testing.assert_close(ret.cpu(), rret, **tol)


@requires_cuda
def test_cuda_long_rows_undiscounted(kernels):
    r, v, m = _batch(2, 32768, torch.float64, seed=2)
    ra, _ = reference_gae(r, v, m, 1.0, 1.0)
    a, _ = gae(r.cuda(), v.cuda(), m.cuda(), 1.0, 1.0)
    torch.testing.assert_close(a.cpu(), ra, **TOL[torch.float64])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("gamma,lam", [(0.9, 0.0), (0.0, 0.95), (0.0, 0.0)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("in_value", [False, True])
def test_nonfinite_score_stays_local(kernels, device, gamma, lam, bad, in_value):
    """With lam = 0 or gamma = 0 a NaN / inf reward or value at k reaches only A_k and (a value,
    gamma > 0) the previous valid position's A: zero coefficients drop their terms. T = 5000 spans
    several tiles of the CUDA scan, whose composed maps multiplied by those zeros before."""
    T, k = 5000, 3001
    r = torch.ones(2, T, device=device)
    v = torch.full((2, T), 0.5, device=device)
    m = torch.ones(2, T, dtype=torch.bool, device=device)
    m[1, k - 1] = False  # row 1: the previous valid position of k is k - 2
    (v if in_value else r)[:, k] = bad
    adv, ret = gae(r, v, m, gamma, lam)
    ref_adv, ref_ret = reference_gae(r.cpu(), v.cpu(), m.cpu(), gamma, lam)
    for row, prev in ((0, k - 1), (1, k - 2)):
        bad_at = {k} | ({prev} if in_value and gamma != 0 else set())
        finite = torch.isfinite(adv[row]).cpu()
        assert set((~finite).nonzero().flatten().tolist()) == bad_at, f"row {row}: non-finite at {(~finite).nonzero()}"
        assert set((~torch.isfinite(ref_adv[row])).nonzero().flatten().tolist()) == bad_at
    torch.testing.assert_close(adv.cpu(), ref_adv, equal_nan=True)
    torch.testing.assert_close(ret.cpu(), ref_ret, equal_nan=True)
