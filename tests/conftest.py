"""Shared test settings: per-dtype tolerances, the float64-oracle rule (`assert_close_to_oracle`),
and fixtures that pin the op path.

Kernel tests use the `kernels` fixture (MEGALIGN_OPS=kernels, so a missing extension fails loudly
instead of silently testing the reference against itself) and compare with
`megalign.ops.reference`. With MEGALIGN_REQUIRE_EXT=1 (set by .ci/run) a missing extension stops
the session instead of skipping the kernel tests.
"""
import os

import pytest
import torch

from megalign.ops import _backend

# Forward/gradient tolerances against an fp64 or fp32 reference. bf16/fp16 outputs are compared
# after the reference is computed in fp32 from the same rounded inputs.
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-9),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}



def assert_close_to_oracle(actual: torch.Tensor, oracle: torch.Tensor, torch_result: torch.Tensor, k: float = 2.0,
                           ulps: float = 2.0, scale: float | None = None, name: str = "result") -> None:
    """flash-attention's tolerance rule, which holds on any CPU or GPU:

        max|actual - oracle| <= k * max|torch_result - oracle| + ulps * eps(actual.dtype) * scale,

    over the entries where the oracle is finite, with scale = max|oracle| (1 where that is 0)
    unless given: a mean whose terms cancel should pass the mean of their magnitudes.

    `oracle` is the quantity in float64 from the same (already rounded) inputs, `torch_result` the
    same quantity from plain torch eager in the precision the code under test computes in, and
    `actual` the code under test. A fixed tolerance against another fp32 implementation fails
    wherever the vector ISA or FMA contraction moves either one by a few ulp; this rule instead
    asks for no more than k times torch's own rounding error. The floor of `ulps` units of the
    result's magnitude keeps a lucky, nearly exact torch result from demanding an exact answer.
    Where the oracle is +-inf or NaN, actual must be the same (same inf, or NaN). Shapes must agree.
    """
    assert actual.shape == oracle.shape == torch_result.shape, (
        f"{name}: shapes {tuple(actual.shape)}, oracle {tuple(oracle.shape)}, torch {tuple(torch_result.shape)}")
    a, o, t = (x.detach().to("cpu", torch.float64) for x in (actual, oracle, torch_result))
    finite = torch.isfinite(o)
    unmatched = ~finite & ~((a == o) | (a.isnan() & o.isnan()))
    assert not unmatched.any(), (f"{name}: oracle is inf/NaN at {unmatched.nonzero()[:5].tolist()} but got "
                                 f"{a[unmatched][:5].tolist()} (oracle {o[unmatched][:5].tolist()})")
    if not finite.any():
        return
    a, o, t = a[finite], o[finite], t[finite]
    err = (a - o).abs().max().item()
    torch_err = (t - o).abs().nan_to_num(nan=0.0, posinf=0.0).max().item()  # torch's inf/NaN sets no bound
    scale = scale or o.abs().max().item() or 1.0
    if actual.dtype == torch.float64:
        # The oracle is then no more precise than the result, and two float64 torch paths may agree
        # by chance, so torch's error bounds nothing: allow the oracle's own rounding as well (a
        # reduction over V terms is off by a few ulps; 6e-16 at scale 0.82 seen on an AVX-512 CPU).
        ulps = max(ulps, 8.0)
    floor = ulps * torch.finfo(actual.dtype).eps * scale
    bound = k * torch_err + floor
    assert err <= bound, (f"{name}: max |error| vs the float64 oracle is {err:.3g} > {k} x torch's {torch_err:.3g} "
                          f"+ floor {floor:.3g} (= {bound:.3g}; {actual.dtype}, scale {scale:.3g})")


requires_ext = pytest.mark.skipif(not _backend.HAVE_EXTENSION, reason="megalign._C is not built")
requires_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and _backend.WITH_CUDA),
    reason="needs a CUDA device and megalign built with its CUDA kernels",
)


def pytest_sessionstart(session):
    if os.environ.get("MEGALIGN_REQUIRE_EXT") == "1" and not _backend.HAVE_EXTENSION:
        raise pytest.UsageError(f"MEGALIGN_REQUIRE_EXT=1 but megalign._C failed to import: {_backend._LOAD_ERROR}")


@pytest.fixture
def kernels(monkeypatch):
    """Run ops through the compiled kernels (skips when the extension is not built)."""
    if not _backend.HAVE_EXTENSION:
        pytest.skip("megalign._C is not built")
    monkeypatch.setenv("MEGALIGN_OPS", "kernels")


@pytest.fixture
def reference(monkeypatch):
    """Run ops through the pure-torch references."""
    monkeypatch.setenv("MEGALIGN_OPS", "reference")
