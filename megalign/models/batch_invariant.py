"""Batch-invariant numerics: the rollout engine's log-probs equal the trainer's recomputation bit for bit.

Why: the engine decodes one token per row against a KV cache, in batches whose size changes as rows finish,
while the trainer recomputes the same log-probs with one forward over whole padded (or packed) sequences. The
same math in different shapes reduces in different orders, so the two differ by rounding (measured on a tiny
Qwen2, CPU, temperature 1: up to 4.8e-7 in fp32 with 72% of tokens equal, up to 2.0e-3 in bf16 with 8% equal).
Which ops break it, measured layer by layer (a 2-layer Qwen2, prefill + KV-cache decode vs one full forward):
in fp32 the first projection of the first layer already differs (the CPU gemm picks another kernel, with
another order over K, for 3 rows than for 60), and attention differs even in the prefill (SDPA's CPU flash
kernel splits queries and keys into blocks sized by the sequence length); in bf16 the matmuls agree (their
rounding to bf16 hides the order) and attention is the first op to differ. RMSNorm, RoPE, the residual adds
and the embedding were already invariant. This mode follows Thinking Machines, "Defeating nondeterminism in
LLM inference" (2025): every reduction whose order could depend on the batch is given a fixed one.

- Matmuls (`rows_matmul`, and aten `mm` / `addmm` / `bmm` on the CPU while the mode is on, so every `nn.Linear`, the
  tensor-parallel layers and the LM head follow): the rows are cut into blocks of `ROW_BLOCK` rows (the last
  padded with zeros) and multiplied block by block, `[ROW_BLOCK, K] @ [K, N]` each (one `mm.out` call a block for a
  2-d matmul, one batched `bmm.out` for aten `bmm`), so the kernel sees the same shape whatever the number of rows
  and a row's result cannot depend on its neighbours. (A loop of `mm.out` rather than one `bmm` of the blocks: the
  same bits, measured, and in bf16 4x faster, since the CPU's bf16 `bmm` has no fast kernel for these shapes.)
- Attention (`attention`, called by `attention.causal_attention`; the SDPA and flash kernels are bypassed):
  fp32 arithmetic on the compute-dtype values (the bf16 cache's keys are the trainer's keys rounded the same
  way), scores as a sum over the head dimension in index order, one elementwise multiply-add per index; the
  softmax's max (exact in any order); exp in fp64 rounded to fp32; then the weighted sum of values and the
  normaliser accumulated key by key in slot order. Masked keys (padding, the future, other packed documents,
  outside the window, unwritten cache slots) add exact zeros, so a left-padded row, a packed document and a
  KV-cache decode step all sum the same keys in the same order: the result does not depend on padding,
  packing, the batch or the cache window. Cost: one Python step per key (the benchmark gives the figure).
- Log-probs (`token_logprobs`, used by the engine's `pick_tokens` and by `LMHead.token_logprob`, which skips its
  fused kernel in this mode): log softmax(logits / T) at the token with the max taken exactly, exp in fp64 and
  the sum over the vocabulary as a `rows_matmul` with a ones column.
- Transcendentals (exp) run in fp64 and are rounded to the working dtype: the vectorised and scalar code paths
  of one op (which element takes which depends on the tensor's size and its split over threads) differ by
  under one fp64 ulp, which the rounding removes except with probability about 2^-29 per value.

Scope: CPU, tp = 1 (under tensor parallelism the head refuses the mode). The switch is process-wide (the aten
override changes every CPU matmul: the reference, critic and reward models run slower too): `set_batch_invariant`,
the `batch_invariant()` context, or `MEGALIGN_BATCH_INVARIANT=1` in the environment when `megalign.models` is
imported. The online trainers turn it on for their whole `train()` with `actor.batch_invariant: true` (the variable,
when set, overrides the key either way; `megalign.trainers.online_config.batch_invariant_switch` refuses a CUDA
device and a tensor-parallel actor or reference at start-up). Gradients flow through every function here (the training forward must equal the rollout too, for
`old_logprobs: rollout`).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

ENV = "MEGALIGN_BATCH_INVARIANT"
ROW_BLOCK = 16
"""Rows per matmul block: every matmul in the mode runs on `[ROW_BLOCK, K]` row blocks."""
LOGPROB_CHUNK = 256
"""Rows per chunk of `token_logprobs` (its fp64 `[chunk, V]` temporary)."""

_library: Optional[torch.library.Library] = None


def enabled() -> bool:
    """Whether the batch-invariant mode is on in this process."""
    return _library is not None


def set_batch_invariant(on: bool) -> None:
    """Turn the mode on (override aten `mm` / `addmm` / `bmm` on the CPU with `rows_matmul`) or off (restore them)."""
    global _library
    if on and _library is None:
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point of the mode
            warnings.simplefilter("ignore", UserWarning)
            lib.impl("mm", _mm, "CPU")
            lib.impl("addmm", _addmm, "CPU")
            lib.impl("bmm", _bmm, "CPU")
        _library = lib
    elif not on and _library is not None:
        _library._destroy()
        _library = None


@contextlib.contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """`with batch_invariant():` the mode on inside the block, restored after."""
    before = enabled()
    set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(before)


def env_override() -> Optional[bool]:
    """`MEGALIGN_BATCH_INVARIANT` as a bool, None when unset or empty (then a trainer's `actor.batch_invariant`
    decides); any value but 0/1/true/false is an error naming it."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("0", "1", "true", "false", ""):
        raise ValueError(f"{ENV}={value!r}: expected 0, 1, true or false")
    return None if value == "" else value in ("1", "true")


def env_switch() -> bool:
    """`MEGALIGN_BATCH_INVARIANT` as a bool (unset = off)."""
    return bool(env_override())


def rows_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a `[M, K]` @ b `[K, N]` -> `[M, N]`, each row computed by the same `[ROW_BLOCK, K] @ [K, N]` kernel call
    whatever M and the row's place (module doc)."""
    if enabled():  # through the dispatcher: autograd records an mm, and the override computes it
        return torch.mm(a, b)
    return _blocks_bmm(a[None], b[None])[0]


def _blocks_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a `[Bt, M, K]` @ b `[Bt, K, N]` as `[ROW_BLOCK, K] @ [K, N]` blocks through `bmm.out` (the overload the mode
    leaves alone, so the overrides do not call themselves); no autograd of its own (under the overrides the
    autograd of mm / addmm / bmm sits above it)."""
    with torch.no_grad():
        return _blocks_bmm_raw(a, b)


def _blocks_bmm_raw(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    bt, m, k = a.shape
    n = b.shape[-1]
    blocks = F.pad(a, (0, 0, 0, (-m) % ROW_BLOCK)).reshape(bt, -1, ROW_BLOCK, k)
    per = blocks.shape[1]
    out = torch.empty(bt * per, ROW_BLOCK, n, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    if bt == 1:  # mm / addmm / rows_matmul: one `mm.out` a block (module doc: 4x faster than bmm in bf16)
        for i, block in enumerate(blocks[0]):
            torch.mm(block, b[0], out=out[i])
    else:
        rhs = b[:, None].expand(bt, per, k, n).reshape(bt * per, k, n)
        torch.bmm(blocks.reshape(bt * per, ROW_BLOCK, k), rhs, out=out)
    return out.view(bt, per * ROW_BLOCK, n)[:, :m]


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _blocks_bmm(a[None], b[None])[0]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _blocks_bmm(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    out = _blocks_bmm(a[None], b[None])[0]
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp in fp64, rounded back to x's dtype (module doc)."""
    return torch.exp(x.double()).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor],
              dtype: torch.dtype) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v in a fixed order (module doc).

    q `[B, h, T, D]`, k and v `[B, h_kv, S, D]` (h_kv divides h), `allowed` `[B or 1, 1, T, S]` bool (True = may
    attend; None = plain causal with the queries the last T of S), `dtype`: the compute dtype (the values are
    rounded to it first, as SDPA would see them). Returns `[B, T, h, D]` in `dtype`.
    """
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    if allowed is None:
        allowed = (torch.arange(s, device=q.device) <= torch.arange(s - t, s, device=q.device)[:, None])[None, None]
    qf, kf, vf = (x.to(dtype).float() for x in (q, k, v))
    qf = qf.view(b, hk, h // hk, t, d)
    scores = qf[..., 0, None] * kf[:, :, None, None, :, 0]
    for i in range(1, d):
        scores = scores + qf[..., i, None] * kf[:, :, None, None, :, i]
    scores = scores * (d ** -0.5)
    keep = allowed[:, :, None]  # [B or 1, 1, 1, T, S]
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = _exp(scores - scores.amax(-1, keepdim=True)).masked_fill(~keep, 0.0)
    vf = vf.masked_fill(~torch.isfinite(vf), 0.0)
    out = torch.zeros(b, hk, h // hk, t, d, dtype=torch.float32, device=q.device)
    norm = torch.zeros(b, hk, h // hk, t, 1, dtype=torch.float32, device=q.device)
    for j in range(s):
        p = probs[..., j, None]
        out = out + p * vf[:, :, None, None, j]
        norm = norm + p
    return (out / norm).view(b, h, t, d).transpose(1, 2).to(dtype)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] `[N]` fp32 for logits `[N, V]` (any float dtype, -inf allowed) and
    targets `[N]`, in a fixed order (module doc); temperature 0 means 1 (greedy decoding's log-probs)."""
    scale = temperature or 1.0
    parts = []
    for start in range(0, logits.shape[0], LOGPROB_CHUNK):
        x = logits[start:start + LOGPROB_CHUNK].float() / scale
        top = x.amax(-1, keepdim=True)
        total = rows_matmul(_exp((x - top).double()), x.new_ones(x.shape[-1], 1, dtype=torch.float64))
        picked = (x.gather(-1, targets[start:start + LOGPROB_CHUNK, None]) - top).double()
        parts.append((picked - total.log())[:, 0].float())
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def head_token_logprob(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                       return_entropy: bool):
    """`LMHead.token_logprob` in the mode: the head's own forward (its matmul through `rows_matmul`, as the engine's
    decode step runs it), then `token_logprobs`; the entropy (when asked) from the same logits, not order-fixed
    (a metric and a loss term, never compared). hidden `[..., H]`, targets `[...]` -> `[...]` fp32 (and entropy)."""
    shape, width = targets.shape, hidden.shape[-1]
    hidden, flat = hidden.reshape(-1, width), targets.reshape(-1)
    logps, entropies = [], []
    for start in range(0, flat.shape[0], LOGPROB_CHUNK):  # the [chunk, V] logits exist one chunk at a time
        logits = head.gather_logits(head(hidden[start:start + LOGPROB_CHUNK]))
        logps.append(token_logprobs(logits, flat[start:start + LOGPROB_CHUNK], temperature))
        if return_entropy:
            log_all = (logits.float() / (temperature or 1.0)).log_softmax(-1)
            probs = log_all.exp()
            entropies.append(-torch.where(probs > 0, probs * log_all, torch.zeros_like(probs)).sum(-1))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    logp = (torch.cat(logps) if logps else empty).view(shape)
    if not return_entropy:
        return logp
    return logp, (torch.cat(entropies) if entropies else empty).view(shape)
