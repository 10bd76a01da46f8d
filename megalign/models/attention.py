"""Causal attention for the decoder: the one place that picks the kernel and lays the batch out for it.

Two backends compute the same function, causal softmax(q k^T / sqrt(D)) v with grouped kv heads (GQA),
an optional sliding window, padding and packed documents:

- `sdpa`: `F.scaled_dot_product_attention` with `enable_gqa` and one boolean mask `[B or 1, 1, T, S]`
  built once per forward (`attention_mask_4d`), or `is_causal=True` when plain causal suffices. It runs
  everywhere (CPU, any dtype, with a KV cache), but with a mask a GPU gets the memory-efficient or math
  kernel and the O(T^2) mask itself.
- `flash`: flash-attn 2 (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
  Partitioning"). An unpadded batch goes to `flash_attn_func` as `[B, T, h, D]`; a padded or packed
  batch is unpadded to `[total_tokens, h, D]` and goes to `flash_attn_varlen_func` with int32
  `cu_seqlens`, so no mask exists and no work is spent on padding. GQA is native (k/v keep their fewer
  heads) and the sliding window is flash-attn's `window_size=(sliding_window - 1, 0)`: query i sees keys
  [i - (sliding_window - 1), i], the same set as the SDPA mask's `i - j < sliding_window` (and as
  transformers' `kv_idx > q_idx - sliding_window`).

`select_backend` decides per layer call, from the dtype the kernel would really see (the autocast dtype
under `torch.autocast`). `MEGALIGN_ATTENTION` overrides it for the whole process:
  auto  (default) flash when it can run (see `select_backend`), else sdpa;
  sdpa  always sdpa (to compare, debug, or on a GPU older than Ampere, which flash-attn 2 rejects).
In the batch-invariant mode (`batch_invariant`) neither runs: its own fixed-order attention does.
Both paths give the same values at real tokens; at padding positions flash gives zeros and sdpa a
finite value that nothing downstream reads.
"""
from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from . import batch_invariant

ATTENTION_ENV = "MEGALIGN_ATTENTION"
_MODES = ("auto", "sdpa")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256  # the largest head size flash-attn 2 has kernels for
_UNSET = object()  # a cached AttentionBatch field not built yet


def attention_mode() -> str:
    """The value of MEGALIGN_ATTENTION ('auto' when unset); anything else is an error naming the variable."""
    value = os.environ.get(ATTENTION_ENV, "auto")
    if value not in _MODES:
        raise ValueError(f"{ATTENTION_ENV}={value!r}: expected one of {', '.join(_MODES)}")
    return value


@functools.cache
def flash_attn_module() -> Optional[ModuleType]:
    """The `flash_attn` package, or None when it does not import. Imported once per process."""
    try:
        return importlib.import_module("flash_attn")
    except ImportError:
        return None


def attention_mask_4d(q_len: int, kv_len: int, key_valid: Optional[torch.Tensor], doc_ids: Optional[torch.Tensor],
                      sliding_window: Optional[int], device: torch.device,
                      query_slots: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Boolean SDPA mask `[B or 1, 1, q_len, kv_len]` (True = may attend), or None when plain causal suffices.

    Queries are the last `q_len` of `kv_len` slots, or, with `query_slots` `[B, q_len]`, each row's queries
    sit at its own slots (rows of a continuous-batching cache decode at different columns,
    `decoder.SlotKVCache`). A query at slot i sees key slot j when j <= i, key_valid[j], (sliding window)
    i - j < sliding_window, and (packing) doc_ids[i] == doc_ids[j].
    Every query also sees itself, so a padding query never has an all-False row (SDPA would give NaN,
    and NaN times a zero gradient is still NaN); its output is padding and is ignored downstream.
    key_valid: `[B, kv_len]` bool; doc_ids: `[B, kv_len]` (only without a cache, so q_len == kv_len).
    """
    windowed = sliding_window is not None and kv_len > sliding_window
    if key_valid is None and doc_ids is None and q_len == kv_len and not windowed and query_slots is None:
        return None
    if query_slots is None:
        q_idx = torch.arange(kv_len - q_len, kv_len, device=device)[None, None, :, None]
    else:
        q_idx = query_slots[:, None, :, None]
    k_idx = torch.arange(kv_len, device=device)
    allowed = k_idx <= q_idx
    if windowed:
        allowed = allowed & (q_idx - k_idx < sliding_window)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    return allowed | (k_idx == q_idx)


@dataclass
class Varlen:
    """A padded or packed batch in flash-attn's variable-length layout.

    indices: `[total_tokens]` int64 positions of the real tokens in the flattened `[B * T]` batch, or None
        when every token is real (a packed batch), so no gather or scatter is needed.
    cu_seqlens: `[n_seqs + 1]` int32 boundaries of the sequences in the unpadded tokens (0, ..., total).
    max_seqlen: the longest sequence, a host int (flash-attn sizes its grid with it).
    gapless: every sequence's real tokens are adjacent (left, right or both-sided padding, or packing).
        Only then are flash-attn's distances within a sequence the slot distances the SDPA mask and
        transformers measure, which matters for a sliding window.
    """

    indices: Optional[torch.Tensor]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    gapless: bool


class AttentionBatch:
    """What attention needs to know about one forward's batch, shared by all its layers.

    The mask SDPA needs and the variable-length layout flash needs are each built on first use and then
    reused by every layer (and by activation-checkpoint recomputation), so a forward pays for at most one
    of each and a flash forward never builds the O(T^2) mask. (A hand-written cache, not
    `functools.cached_property`: on Python 3.11 that takes a lock, which torch.compile cannot trace.)

    Args:
        q_len, kv_len: new tokens T and keys S (S = cache length + T with a KV cache, else T).
        key_valid: `[B, S]` bool, False at padding; None when no attention_mask was given.
        doc_ids: `[1, T]` document index of each packed token, with `cu_seqlens` its `[n_docs + 1]`
            boundaries (already validated by the caller); both None when not packed.
        sliding_window: Mistral's window (keys with i - j < sliding_window), or None.
        has_kv_cache: the forward reads or fills a KV cache.
        query_slots: `[B, T]` the cache slot of each query when rows sit at different columns of the cache
            (`decoder.SlotKVCache`); None: the queries are the last T of the S slots.
    """

    def __init__(self, q_len: int, kv_len: int, key_valid: Optional[torch.Tensor], doc_ids: Optional[torch.Tensor],
                 cu_seqlens: Optional[torch.Tensor], sliding_window: Optional[int], has_kv_cache: bool,
                 device: torch.device, query_slots: Optional[torch.Tensor] = None):
        self.q_len, self.kv_len = q_len, kv_len
        self.query_slots = query_slots
        self.key_valid, self.doc_ids, self.cu_seqlens = key_valid, doc_ids, cu_seqlens
        self.sliding_window = sliding_window
        self.has_kv_cache = has_kv_cache
        self.device = device
        self._sdpa_mask = self._varlen = _UNSET

    @property
    def sdpa_mask(self) -> Optional[torch.Tensor]:
        """`attention_mask_4d` of this batch."""
        if self._sdpa_mask is _UNSET:
            self._sdpa_mask = attention_mask_4d(self.q_len, self.kv_len, self.key_valid, self.doc_ids,
                                                self.sliding_window, self.device, self.query_slots)
        return self._sdpa_mask

    @property
    def varlen(self) -> Optional[Varlen]:
        """`_build_varlen`, built once."""
        if self._varlen is _UNSET:
            self._varlen = self._build_varlen()
        return self._varlen

    def _build_varlen(self) -> Optional[Varlen]:
        """The variable-length layout of a padded or packed batch (no KV cache); None for a plain batch.

        One host sync per forward (max_seqlen and the gap check; the unpadding gather's nonzero), as in
        flash-attn's own `bert_padding.unpad_input`.
        """
        if self.cu_seqlens is not None:
            lengths = self.cu_seqlens.diff()
            return Varlen(None, self.cu_seqlens.to(self.device, torch.int32), int(lengths.max()), True)
        if self.key_valid is None:
            return None
        valid = self.key_valid
        lengths = valid.sum(-1, dtype=torch.int32)
        first = valid.int().argmax(-1)
        last = valid.shape[1] - 1 - valid.flip(-1).int().argmax(-1)
        has_gap = ((last - first + 1 != lengths) & (lengths > 0)).any()
        max_seqlen, gap = torch.stack([lengths.max(), has_gap.int()]).tolist()
        return Varlen(valid.flatten().nonzero().squeeze(1), F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)),
                      max_seqlen, not gap)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for `x`: the autocast dtype when autocast is on for its device (SDPA is on
    autocast's lower-precision list), else x's own (RoPE's fp32 tables can promote q and k to fp32)."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def flash_kernel_supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash-attn 2's kernels exist for this device, dtype and head size: CUDA, fp16/bf16, D <= 256."""
    return device.type == "cuda" and dtype in _FLASH_DTYPES and head_dim <= _FLASH_MAX_HEAD_DIM


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int, batch: AttentionBatch) -> str:
    """'flash' or 'sdpa' for attention in `dtype` on `device` over `batch`.

    flash needs all of: MEGALIGN_ATTENTION=auto; no KV cache; a kernel for the device, dtype and head size
    (`flash_kernel_supports`); `flash_attn` importable; and, with a sliding window, padding that leaves no
    gap inside a sequence (a gap would shrink flash's window distances below the slot distances the SDPA
    mask and transformers use). Decoding with a KV cache stays on SDPA: its cache is `[B, h, S, D]` with
    left padding inside it, which `flash_attn_with_kvcache` cannot express without a per-row left-pad
    and cache layout of its own, and with one query per step SDPA's mask is only O(S) anyway.
    """
    if attention_mode() == "sdpa" or batch.has_kv_cache or not flash_kernel_supports(device, dtype, head_dim):
        return "sdpa"
    if flash_attn_module() is None:
        return "sdpa"
    if batch.sliding_window is not None and batch.varlen is not None and not batch.varlen.gapless:
        return "sdpa"
    return "flash"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """q `[B, h, T, D]`, k and v `[B, h_kv, S, D]` (h_kv divides h) -> `[B, T, h, D]`, by `select_backend`'s choice."""
    dtype = compute_dtype(q)
    if batch_invariant.enabled():  # fixed reduction order whatever the batch, padding, packing or cache (its doc)
        return batch_invariant.attention(q, k, v, batch.sdpa_mask, dtype)
    if select_backend(q.device, dtype, q.shape[-1], batch) == "flash":
        return _flash_attention(*(x.transpose(1, 2).to(dtype) for x in (q, k, v)), batch)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.sdpa_mask, is_causal=batch.sdpa_mask is None,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """q `[B, T, h, D]`, k and v `[B, T, h_kv, D]` (no cache: S = T) -> `[B, T, h, D]`, zeros at padding."""
    flash_attn = flash_attn_module()
    b, t, h, d = q.shape
    scale = d ** -0.5
    window = (-1, -1) if batch.sliding_window is None else (batch.sliding_window - 1, 0)
    layout = batch.varlen
    if layout is None:
        return flash_attn.flash_attn_func(q, k, v, causal=True, softmax_scale=scale, window_size=window)
    q, k, v = (x.reshape(b * t, x.shape[2], d) for x in (q, k, v))
    if layout.indices is not None:
        q, k, v = (x[layout.indices] for x in (q, k, v))
    out = flash_attn.flash_attn_varlen_func(
        q.contiguous(), k.contiguous(), v.contiguous(), layout.cu_seqlens, layout.cu_seqlens,
        layout.max_seqlen, layout.max_seqlen, causal=True, softmax_scale=scale, window_size=window,
    )
    if layout.indices is not None:
        out = out.new_zeros(b * t, h, d).index_copy(0, layout.indices, out)
    return out.view(b, t, h, d)
