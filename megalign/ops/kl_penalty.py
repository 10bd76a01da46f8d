"""KL penalty between a policy and a reference model, per token, with a fused masked mean.

    kl_penalty(logp, ref_logp, kind="k3") -> kl                      [*] -> [*]
    kl_penalty_masked_mean(logp, ref_logp, mask, kind="k3") -> mean  [*] -> []

Estimators (Schulman, "Approximating KL Divergence", 2020; names as in verl's `kl_penalty`), with
d = ref_logp - logp:

    k1          logp - ref_logp                 unbiased, high variance, can be negative
    abs         |logp - ref_logp|               (verl's "abs")
    k2          0.5 * (logp - ref_logp)^2       low variance, biased
    k3          e^d - d - 1                     unbiased, low variance, >= 0, 0 only at logp == ref_logp
    low_var_kl  clamp(e^dc - dc - 1, -10, 10), dc = clamp(d, -20, 20)   (verl; gradient 0 where a
                clamp is active)

"kl" and "mse" are accepted as aliases of "k1" and "k2" (verl's names). Unlike verl, "k3" is the
plain estimator; verl's clamped variant is "low_var_kl". k3 is evaluated as expm1(d) - d so it
cannot round below zero.

Inputs: `logp` and `ref_logp` of one float dtype (fp32, fp64, bf16, fp16), same shape, any
strides. Outputs and all arithmetic are fp32 (fp64 for fp64 inputs). Gradients flow to both
inputs (d/d ref_logp = -d/d logp, as every estimator depends on logp - ref_logp only) in their
dtype. On the CPU kernels with fp32 / fp64 inputs that need a gradient, the forward pass also
writes d kl / d logp per token from the same evaluation of the estimator (`with_dlogp`), and the
backward only scales that buffer in place by the upstream gradient: one evaluation of the
estimator per token instead of two, and no fresh buffer for grad_logp; with one upstream value
(a masked mean, or a sum) d/d ref_logp is written in that same pass. A second backward through
a retained graph recomputes it with the backward kernel. The kernels' autograd is C++
(`csrc/torch/autograd.cpp`: no Python autograd function around a sub-millisecond op). The masked
mean reads `mask` (bool, uint8, int32, int64 or float; nonzero = valid token, never a weight) in
the same single pass; with no valid token it returns 0, not NaN, and zero gradients.
"""
from __future__ import annotations

import torch

from megalign.ops import _backend
from megalign.ops._backend import FLOAT_DTYPES
from megalign.ops.common import acc_dtype, resolve_kind
from megalign.ops.reference.kl_penalty import kl_penalty as reference_kl_penalty
from megalign.ops.reference.kl_penalty import kl_penalty_masked_mean as reference_kl_penalty_masked_mean

MASK_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64) + FLOAT_DTYPES


def check_operands(op: str, logp: torch.Tensor, mask: torch.Tensor | None = None, **others: torch.Tensor | None) -> None:
    """Checks shared by the KL and policy-loss ops; every error names the offending argument.

    `logp` fixes the float dtype, shape and device; each of `others` (None = absent) must match
    them; `mask` must match shape and device and have one of MASK_DTYPES.
    """
    if not isinstance(logp, torch.Tensor):
        raise TypeError(f"{op}: logp must be a tensor, got {type(logp).__name__}")
    if logp.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: logp must be float32, float64, bfloat16 or float16, got {logp.dtype}")
    for name, t in others.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype != logp.dtype:
            raise TypeError(f"{op}: {name} must have the dtype of logp ({logp.dtype}), got {t.dtype}")
    named = dict(others, mask=mask)
    for name, t in named.items():
        if t is None:
            continue
        if t.shape != logp.shape:
            raise ValueError(f"{op}: {name} must have the shape of logp {tuple(logp.shape)}, got {tuple(t.shape)}")
        if t.device != logp.device:
            raise ValueError(f"{op}: {name} is on {t.device} but logp is on {logp.device}")
    if mask is not None and mask.dtype not in MASK_DTYPES:
        raise TypeError(f"{op}: mask must be bool, uint8, int32, int64 or a float dtype, got {mask.dtype}")


def wants_dlogp(logp: torch.Tensor, *differentiable: torch.Tensor | None) -> bool:
    """Whether a kernel forward should also write d out / d logp for its backward (module doc).

    Only the CPU kernels write it, and only for fp32 / fp64 inputs, whose gradient dtype is the
    buffer's (acc) dtype so the backward can scale it in place; only when autograd will need a
    gradient for one of `differentiable` (logp and the other inputs with a gradient).
    """
    return (logp.device.type == "cpu" and logp.dtype in (torch.float32, torch.float64) and torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (logp, *differentiable)))


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate `kind` of logp against ref_logp; [*] -> [*] in fp32 (fp64 for fp64)."""
    kind = resolve_kind(kind)
    check_operands("kl_penalty", logp, ref_logp=ref_logp)
    if _backend.use_kernels(logp):
        return torch.ops.megalign.kl_penalty_fwd(logp, ref_logp, kind, wants_dlogp(logp, ref_logp))[0]
    return reference_kl_penalty(logp, ref_logp, kind)


def kl_penalty_masked_mean(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                           kind: str = "k3") -> torch.Tensor:
    """sum(kl * valid) / count(valid) over all tokens as a 0-d tensor, fused in one pass; 0 if no token is valid."""
    kind = resolve_kind(kind)
    check_operands("kl_penalty_masked_mean", logp, mask=mask, ref_logp=ref_logp)
    if _backend.use_kernels(logp):
        return torch.ops.megalign.kl_masked_mean_fwd(logp, ref_logp, mask, kind, wants_dlogp(logp, ref_logp))[0]
    return reference_kl_penalty_masked_mean(logp, ref_logp, mask, kind)


def _register() -> None:
    acc = acc_dtype

    def dlogp_like(logp, with_dlogp):
        return logp.new_empty(logp.shape if with_dlogp else (0,), dtype=acc(logp.dtype))

    @torch.library.register_fake("megalign::kl_penalty_fwd")
    def _(logp, ref_logp, kind, with_dlogp=False):
        return logp.new_empty(logp.shape, dtype=acc(logp.dtype)), dlogp_like(logp, with_dlogp)

    @torch.library.register_fake("megalign::kl_penalty_bwd")
    def _(grad, logp, ref_logp, kind):
        return torch.empty_like(logp, memory_format=torch.contiguous_format)

    @torch.library.register_fake("megalign::kl_masked_mean_fwd")
    def _(logp, ref_logp, mask, kind, with_dlogp=False):
        return (logp.new_empty((), dtype=acc(logp.dtype)), logp.new_empty((), dtype=torch.int64),
                dlogp_like(logp, with_dlogp))

    @torch.library.register_fake("megalign::kl_masked_mean_bwd")
    def _(grad, count, logp, ref_logp, mask, kind):
        return torch.empty_like(logp, memory_format=torch.contiguous_format)


if _backend.HAVE_EXTENSION:
    _register()
