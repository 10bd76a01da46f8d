"""megalign.ops.group_advantages: kernels vs the vectorised reference, hand-worked numbers."""
import math

import pytest
import torch
from conftest import TOL, requires_cuda

from megalign.ops.group_advantages import group_advantages
from megalign.ops.reference.group_advantages import group_advantages as reference

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
MODES = ["grpo", "dr_grpo", "rloo"]
PATHS = ["kernels", "reference"]


@pytest.fixture(params=PATHS)
def path(request):
    request.getfixturevalue(request.param)
    return request.param


def test_hand_worked_grpo(path):
    # scores [1,0,0,0,0,0], mean 1/6, eps 1e-4.
    s = torch.tensor([1.0, 0, 0, 0, 0, 0])
    # Population std (unbiased=False): sqrt(5)/6 = 0.372678 -> 0.833333/0.372778 = 2.23547, -0.166667/0.372778 = -0.44709.
    pop = group_advantages(s, group_size=6, eps=1e-4, unbiased=False)
    torch.testing.assert_close(pop, torch.tensor([2.23547] + [-0.44709] * 5), atol=1e-5, rtol=0)
    # Unbiased std (n - 1, torch.std's default): sqrt(1/6) = 0.408248 -> 2.04074, -0.40815.
    unb = group_advantages(s, group_size=6, eps=1e-4, unbiased=True)
    torch.testing.assert_close(unb, torch.tensor([2.04074] + [-0.40815] * 5), atol=1e-5, rtol=0)


def test_hand_worked_rloo_dr_grpo(path):
    s = torch.tensor([1.0, 0, 0, 0, 0, 0, 3, 1, 2])
    g = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1])
    # rloo: 1 - mean(0,0,0,0,0) = 1; 0 - mean(1,0,0,0,0) = -0.2; 3 - 1.5 = 1.5; 1 - 2.5 = -1.5; 2 - 2 = 0.
    torch.testing.assert_close(group_advantages(s, group_index=g, mode="rloo"),
                               torch.tensor([1.0, -0.2, -0.2, -0.2, -0.2, -0.2, 1.5, -1.5, 0.0]))
    # dr_grpo: r - mean: 5/6, -1/6, then 3 - 2, 1 - 2, 2 - 2.
    torch.testing.assert_close(group_advantages(s, group_index=g, mode="dr_grpo"),
                               torch.tensor([5 / 6] + [-1 / 6] * 5 + [1.0, -1.0, 0.0]))


def test_hand_worked_uneven_ids(path):
    # ids [7, 7, 3, 9, 3, 7]: group 7 = {1, 2, 6} (mean 3), group 3 = {3, 5} (mean 4), group 9 = {4} (alone).
    s = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    ids = torch.tensor([7, 7, 3, 9, 3, 7])
    torch.testing.assert_close(group_advantages(s, group_index=ids, mode="dr_grpo"),
                               torch.tensor([-2.0, -1.0, -1.0, 0.0, 1.0, 3.0]))
    # rloo = n/(n-1) * (r - mean): 1.5 * (-2, -1, 3) and 2 * (-1, 1).
    torch.testing.assert_close(group_advantages(s, group_index=ids, mode="rloo"),
                               torch.tensor([-3.0, -1.5, -2.0, 0.0, 2.0, 4.5]))
    # grpo, unbiased: group 7 std = sqrt((4 + 1 + 9) / 2) = sqrt(7); group 3 std = sqrt(2); eps 0.
    want = torch.tensor([-2 / math.sqrt(7), -1 / math.sqrt(7), -1 / math.sqrt(2), 0.0, 1 / math.sqrt(2),
                         3 / math.sqrt(7)])
    torch.testing.assert_close(group_advantages(s, group_index=ids, eps=0.0), want)
    # grpo, population std: group 7 std = sqrt(14 / 3); group 3 std = sqrt(2 / 2) = 1.
    pop = math.sqrt(14 / 3)
    want = torch.tensor([-2 / pop, -1 / pop, -1.0, 0.0, 1.0, 3 / pop])
    torch.testing.assert_close(group_advantages(s, group_index=ids, eps=0.0, unbiased=False), want)


@pytest.mark.parametrize("mode", MODES)
def test_singletons_and_equal_scores_are_zero(path, mode):
    s = torch.tensor([0.3, -2.0, 0.7, 0.7, 0.7, 0.7, 0.1, 0.1, 0.1, 0.1])
    assert torch.equal(group_advantages(s, group_size=1, mode=mode, eps=0.0), torch.zeros(10))
    out = group_advantages(s[2:], group_size=4, mode=mode, eps=0.0)
    assert torch.equal(out, torch.zeros(8))
    ids = torch.tensor([5, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    out = group_advantages(s, group_index=ids, mode=mode, eps=0.0, unbiased=False)
    assert torch.equal(out, torch.zeros(10))


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([-5, 0, 3, 7, 9, 1000, 10**12])  # sparse, negative and huge ids
    return pool[torch.randint(0, pool.numel(), (n,), generator=g)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unbiased", [True, False])
def test_kernel_vs_reference(kernels, dtype, mode, unbiased):
    g = torch.Generator().manual_seed(0)
    s = (2.0 + torch.randn(60, generator=g)).to(dtype)
    tol = TOL[torch.float64 if dtype == torch.float64 else torch.float32]  # same rounded inputs, fp32 math
    for size in (1, 2, 5, 12, 60):
        out = group_advantages(s, group_size=size, mode=mode, unbiased=unbiased)
        assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(out, reference(s, group_size=size, mode=mode, unbiased=unbiased), **tol)
    ids = _ids(60, 1)
    out = group_advantages(s, group_index=ids, mode=mode, unbiased=unbiased)
    torch.testing.assert_close(out, reference(s, group_index=ids, mode=mode, unbiased=unbiased), **tol)


def _layouts(n, seed):
    """Id layouts the CPU kernel walks differently: scattered, runs of equal ids (one id in several
    runs, runs past 16 members), contiguous runs, all distinct."""
    g = torch.Generator().manual_seed(seed)
    runs = torch.repeat_interleave(_ids(n, seed)[:n // 4 + 1], torch.randint(1, 40, (n // 4 + 1,), generator=g))[:n]
    return {"scattered": _ids(n, seed), "runs": runs, "contiguous": torch.arange(n) // 24 * 7919 - 10**9,
            "distinct": torch.randperm(n, generator=g) * -(2**40)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unbiased", [True, False])
def test_id_layouts_vs_reference(kernels, mode, unbiased):
    g = torch.Generator().manual_seed(4)
    s = 1.0 + torch.randn(2001, generator=g, dtype=torch.float64)  # odd length
    for name, ids in _layouts(2001, 5).items():
        assert ids.shape == s.shape, name
        out = group_advantages(s, group_index=ids, mode=mode, unbiased=unbiased)
        torch.testing.assert_close(out, reference(s, group_index=ids, mode=mode, unbiased=unbiased),
                                   **TOL[torch.float64], msg=name)


def test_large_contiguous_groups(kernels):
    # Above 2^17 scores the CPU kernel splits the groups across OpenMP threads.
    g = torch.Generator().manual_seed(9)
    s = torch.randn(2**17 + 96, generator=g, dtype=torch.float64)  # 32 * 4099 scores
    for size in (32, 4099):
        for mode in MODES:
            torch.testing.assert_close(group_advantages(s, group_size=size, mode=mode),
                                       reference(s, group_size=size, mode=mode), **TOL[torch.float64])


def test_cpu_kernel_maps_ids_itself(kernels, monkeypatch):
    # The CPU path numbers the ids in the kernel: no torch.unique (a sort) runs first.
    s, ids = torch.randn(64), _ids(64, 7)
    want = reference(s, group_index=ids)

    def no_unique(*args, **kwargs):
        raise AssertionError("torch.unique called on the CPU kernel path")

    monkeypatch.setattr(torch, "unique", no_unique)
    torch.testing.assert_close(group_advantages(s, group_index=ids), want)


@pytest.mark.parametrize("n", [0, 1])
def test_tiny(kernels, n):
    s = torch.randn(n)
    assert torch.equal(group_advantages(s, group_size=1), torch.zeros(n))
    assert torch.equal(group_advantages(s, group_index=torch.arange(n)), torch.zeros(n))


def test_int32_ids_and_non_contiguous(kernels):
    s = torch.randn(40, 2)[:, 1]
    assert not s.is_contiguous()
    ids = _ids(40, 2)
    want = reference(s.contiguous(), group_index=ids)
    torch.testing.assert_close(group_advantages(s, group_index=(ids % 1000).to(torch.int32)),
                               reference(s.contiguous(), group_index=ids % 1000))
    torch.testing.assert_close(group_advantages(s, group_index=ids), want)
    torch.testing.assert_close(group_advantages(s, group_size=8), reference(s.contiguous(), group_size=8))
    strided_ids = torch.stack([ids, -ids], dim=1)[:, 0]
    assert not strided_ids.is_contiguous()
    torch.testing.assert_close(group_advantages(s, group_index=strided_ids), want)
    for dtype in (torch.uint8, torch.int8, torch.int16):
        small = (ids % 100).to(dtype)
        torch.testing.assert_close(group_advantages(s, group_index=small),
                                   reference(s.contiguous(), group_index=ids % 100), msg=str(dtype))


def test_no_gradients(path):
    s = torch.randn(8, requires_grad=True)
    assert not group_advantages(s, group_size=4).requires_grad
    assert not group_advantages(s, group_index=torch.arange(8) % 3).requires_grad


def test_bad_inputs():
    s = torch.randn(6)
    with pytest.raises(ValueError, match="group_size.*group_index"):
        group_advantages(s)
    with pytest.raises(ValueError, match="group_size.*group_index"):
        group_advantages(s, group_size=3, group_index=torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="group_size 4 does not divide the number of scores 6"):
        group_advantages(s, group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(s, group_size=0)
    with pytest.raises(ValueError, match="group_index must have the shape"):
        group_advantages(s, group_index=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="group_index"):
        group_advantages(s, group_index=torch.zeros(6))
    with pytest.raises(TypeError, match="group_index must be an integer tensor"):
        group_advantages(s, group_index=torch.zeros(6, dtype=torch.bool))
    with pytest.raises(TypeError, match="group_index must be a tensor"):
        group_advantages(s, group_index=[0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="group_index must have the shape"):
        group_advantages(s, group_index=torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="scores"):
        group_advantages(s.view(2, 3), group_size=3)
    with pytest.raises(TypeError, match="scores"):
        group_advantages(torch.arange(6), group_size=3)
    with pytest.raises(ValueError, match="mode"):
        group_advantages(s, group_size=3, mode="ppo")
    with pytest.raises(ValueError, match="eps"):
        group_advantages(s, group_size=3, eps=-1.0)


def test_op_checks(kernels):
    s = torch.randn(6)
    with pytest.raises(RuntimeError, match="group_ids must lie in"):
        torch.ops.megalign.group_advantages_indexed(s, torch.tensor([0, 1, 2, 0, 1, 3]), 3, "grpo", 1e-6, True)
    with pytest.raises(RuntimeError, match="group_ids must be Long"):
        torch.ops.megalign.group_advantages_indexed(s, torch.zeros(6, dtype=torch.int32), 1, "grpo", 1e-6, True)
    with pytest.raises(RuntimeError, match="mode must be one of"):
        torch.ops.megalign.group_advantages(s, 3, "ppo", 1e-6, True)
    with pytest.raises(RuntimeError, match="group_size 4 does not divide"):
        torch.ops.megalign.group_advantages(s, 4, "grpo", 1e-6, True)
    by_id = torch.ops.megalign.group_advantages_by_id
    with pytest.raises(RuntimeError, match="group_advantages_by_id: group_index must be an integer tensor, got Float"):
        by_id(s, torch.zeros(6), "grpo", 1e-6, True)
    with pytest.raises(RuntimeError, match="group_index must be an integer tensor, got Bool"):
        by_id(s, torch.zeros(6, dtype=torch.bool), "grpo", 1e-6, True)
    with pytest.raises(RuntimeError, match="group_index must have the shape of scores"):
        by_id(s, torch.zeros(5, dtype=torch.int64), "grpo", 1e-6, True)
    with pytest.raises(RuntimeError, match="group_index must have 1 dimensions"):
        by_id(s, torch.zeros(2, 3, dtype=torch.int64), "grpo", 1e-6, True)
    with pytest.raises(RuntimeError, match="scores must be float32"):
        by_id(torch.arange(6), torch.zeros(6, dtype=torch.int64), "grpo", 1e-6, True)
    with pytest.raises(RuntimeError, match="mode must be one of"):
        by_id(s, torch.zeros(6, dtype=torch.int64), "ppo", 1e-6, True)


def test_dense_ids_op(kernels):
    # The dense-id op (what the CUDA path calls after torch.unique) gives the same numbers on the CPU.
    g = torch.Generator().manual_seed(8)
    s = torch.randn(300, generator=g)
    ids = torch.randint(0, 40, (300,), generator=g)
    for mode in MODES:
        out = torch.ops.megalign.group_advantages_indexed(s, ids, 41, mode, 1e-6, False)  # group 40 empty
        torch.testing.assert_close(out, reference(s, group_index=ids, mode=mode, unbiased=False))


def test_opcheck(kernels):
    s = torch.randn(12)
    torch.library.opcheck(torch.ops.megalign.group_advantages.default, (s, 4, "grpo", 1e-6, True))
    torch.library.opcheck(torch.ops.megalign.group_advantages_indexed.default,
                          (s, torch.arange(12) % 5, 5, "rloo", 1e-6, False))
    torch.library.opcheck(torch.ops.megalign.group_advantages_by_id.default,
                          (s, (torch.arange(12) % 5) * -(10**12), "dr_grpo", 1e-6, True))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_vs_reference(kernels, dtype, mode):
    g = torch.Generator().manual_seed(3)
    s = (1.0 + torch.randn(16384, generator=g)).to(dtype)
    tol = TOL[torch.float64 if dtype == torch.float64 else torch.float32]
    for size in (1, 4, 16, 64, 4096):
        out = group_advantages(s.cuda(), group_size=size, mode=mode)
        torch.testing.assert_close(out.cpu(), reference(s, group_size=size, mode=mode), **tol)
    ids = torch.randint(0, 3000, (16384,), generator=g) * 7
    out = group_advantages(s.cuda(), group_index=ids.cuda(), mode=mode, unbiased=False)
    want = reference(s, group_index=ids, mode=mode, unbiased=False)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4 if dtype != torch.float64 else 1e-10, rtol=1e-4)
    eq = torch.full((64,), 0.7, dtype=dtype).cuda()
    assert torch.equal(group_advantages(eq, group_index=torch.arange(64).cuda() % 3, eps=0.0).cpu(), torch.zeros(64))
