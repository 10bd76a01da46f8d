"""Chooses between the compiled kernels (`megalign._C`, reached as torch.ops.megalign.*) and the
pure-torch references in `megalign.ops.reference`.

`MEGALIGN_OPS` selects the path for the whole process:
  auto       (default) kernels when the extension is built for the tensors' device, else reference;
  reference  always the references (to compare, debug, or run on a device without kernels);
  kernels    always the kernels: a missing extension is an error instead of a fallback.

A missing extension gives one warning at import and falls back to the references, so
`import megalign` works from a plain source checkout.
"""
from __future__ import annotations

import os
import warnings

import torch

_MODES = ("auto", "reference", "kernels")

# The floating dtypes every kernel (and its reference) accepts.
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

try:
    from megalign import _C  # noqa: F401  (importing registers torch.ops.megalign.*)

    _LOAD_ERROR: Exception | None = None
    WITH_CUDA = bool(_C.WITH_CUDA)
except ImportError as exc:  # no compiled extension in this checkout / install
    _C = None
    _LOAD_ERROR = exc
    WITH_CUDA = False

HAVE_EXTENSION = _C is not None


def mode() -> str:
    value = os.environ.get("MEGALIGN_OPS", "auto")
    if value not in _MODES:
        raise ValueError(f"MEGALIGN_OPS={value!r}: expected one of {', '.join(_MODES)}")
    return value


if not HAVE_EXTENSION and mode() != "reference":
    warnings.warn(
        f"megalign._C is not built ({_LOAD_ERROR}); megalign.ops uses the pure-torch references. "
        "Build the kernels with `pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=2,
    )


def use_kernels(*tensors: torch.Tensor) -> bool:
    """True when the op should run the compiled kernel for these tensors' device.

    Raises under MEGALIGN_OPS=kernels when no kernel exists for that device.
    """
    m = mode()
    if m == "reference":
        return False
    device = tensors[0].device
    available = HAVE_EXTENSION and (device.type == "cpu" or (device.type == "cuda" and WITH_CUDA))
    if m == "kernels" and not available:
        reason = _LOAD_ERROR if not HAVE_EXTENSION else "the CUDA kernels were not compiled"
        raise RuntimeError(f"MEGALIGN_OPS=kernels but no megalign kernel for {device}: {reason}")
    return available
