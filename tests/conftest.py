"""Shared test settings: per-dtype tolerances, and fixtures that pin the op path.

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
