"""Mixed precision for training: bf16 compute over fp32 master weights, with fp32 gradient accumulation.

Design choice: autocast over an fp32 model, not a bf16 model with a separate fp32 master copy.

- The parameters stay fp32 and *are* the master weights: the optimizer (plain or ZeRO-1) updates
  them directly, so there is no bf16 <-> fp32 copy to keep in sync after each step, and
  `allreduce_gradients`, `clip_grad_norm_` and checkpointing see ordinary fp32 tensors.
- Inside `MixedPrecision.autocast()` matmuls (every linear, the attention) run in the compute
  dtype: torch casts each weight once per autocast region (and again when activation checkpointing
  recomputes a layer; `torch.utils.checkpoint` restores the autocast state). Activations, and so the
  tensor-parallel all-reduces on them, are bf16, as in Megatron. RMSNorm normalises in fp32 itself.
- The backward flows through the casts into fp32 `.grad`: gradients of successive micro-batches
  accumulate in fp32 (Megatron's `main_grad`), and the dp all-reduce sums fp32.
- Memory per parameter: 4 (fp32 weight) + 4 (fp32 grad) bytes plus transient bf16 copies of the
  weights in use, against Megatron's 2 (bf16 weight) + 4 (fp32 main weight) + 4 (fp32 main grad).
  The price is one cast per weight per forward.
- The LM head's logits come out in bf16 (half the memory of `[tokens, V / tp]`); the log-prob
  kernels accumulate in fp32 whatever their input dtype.
- fp16 is refused: it needs dynamic loss scaling, which this module does not do; bf16 has fp32's
  exponent range and needs none.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass(frozen=True)
class MixedPrecision:
    """How a model computes: `compute_dtype=torch.bfloat16` for bf16 matmuls, None for plain fp32."""

    compute_dtype: Optional[torch.dtype] = torch.bfloat16
    """dtype of matmuls and activations under `autocast()`; None = no autocast (fp32 throughout)."""

    def __post_init__(self) -> None:
        if self.compute_dtype not in (torch.bfloat16, None):
            raise ValueError(f"MixedPrecision: compute_dtype must be torch.bfloat16 or None, got {self.compute_dtype} "
                             f"(fp16 would need loss scaling)")

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError unless every floating-point parameter is fp32: the master weights and gradients must be."""
        wrong = [f"{name} ({p.dtype})" for name, p in model.named_parameters()
                 if p.is_floating_point() and p.dtype != torch.float32]
        if wrong:
            raise ValueError(f"MixedPrecision: parameters must stay fp32 (master weights); "
                             f"{len(wrong)} are not: {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}")

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Context for the forward (and the loss): matmuls in `compute_dtype` on `device`'s type. Run backward outside it."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.compute_dtype)
