"""The decoder trunk shared by Llama 2/3, Qwen2/2.5, Qwen3 and Mistral: embeddings -> L x (attention + SwiGLU) -> RMSNorm.

Qwen3-MoE and Mixtral are the same trunk with a mixture-of-experts MLP (`moe.MoEMLP`) in the layers
`ModelConfig.is_moe_layer` names; a `moe.Routing` attached to the decoder (`moe.moe_routing`) records,
replays and collects the load-balancing statistics of the routing for one forward.

Design choices:
- Every projection and the embedding are built by one `LayerFactory`. `LayerFactory` builds plain
  `nn.Linear` and `megalign.parallel.Embedding` (an `nn.Embedding` whose backward adds its rows into
  the weight's `.grad`, `embedding_into_grad`) at tensor-parallel size 1; a tensor-parallel factory
  returns `VocabParallelEmbedding` / `ColumnParallelLinear` / `RowParallelLinear` instead and nothing
  else in the model changes. Attention reads its per-rank head counts (`n_heads_local`,
  `n_kv_heads_local`) from the factory's `tp_size`, so the model never assumes it holds all heads.
  Qwen3's per-head q/k RMSNorm (`ModelConfig.qk_norm`) is built by the factory too (`head_norm`): its
  one gain is shared by every head, so under tensor parallelism each rank's gradient must be summed.
- Attention (`attention.causal_attention`) runs flash-attn 2 when it is installed and the inputs are
  fp16/bf16 on a GPU without a KV cache (padded and packed batches through its variable-length kernel,
  no mask), else `F.scaled_dot_product_attention` with `enable_gqa` and one boolean mask `[B, 1, T, S]`
  (or `is_causal=True`); either way the kv heads are never repeated in memory. The per-forward batch
  description (`AttentionBatch`) is built once and shared by all layers.
- Three batch layouts, each with its own position ids:
  padded `[B, T]` + `attention_mask` (left or right padding; positions count only real tokens),
  packed `[1, total]` + `cu_seqlens` (positions restart per document; a document-id mask, or flash-attn's
  varlen boundaries, stop attention across documents), and incremental decoding with a `KVCache`
  (positions passed by the caller).
- Numerics follow `transformers` (RMSNorm in fp32, RoPE tables in fp32 cast to the activation dtype) so
  fp32 logits agree to rounding.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalign.parallel import Embedding
from megalign.parallel.collectives import Group, copy_to_group

from .attention import AttentionBatch, causal_attention
from .config import ModelConfig, RopeScaling
from .moe import ForwardRouting, MoEMLP, Routing


class LayerFactory:
    """Builds every embedding and projection of a model: the single place tensor parallelism plugs in.

    This factory is tensor-parallel size 1: modules hold whole weights. A tensor-parallel factory
    (`megalign.models.parallelize.TensorParallelFactory`) overrides the four builders (and `tp_size`,
    `tp_rank`) so that
    - `embedding` returns a vocab-parallel embedding holding rows `vocab_range(num_embeddings)`,
    - `column_linear` returns a layer whose output features are split over ranks (q/k/v, gate/up, LM head),
      output not gathered: attention and the MLP work on the local slice,
    - `row_linear` returns a layer whose input features are split and whose output is all-reduced (o, down),
    - `head_norm` returns a whole per-head norm whose gain's gradient is summed over ranks (Qwen3's q/k norms),
    and the three collectives below, which code outside the layers needs (full logits for sampling,
    one sampled token for all ranks, whole tensors for saving). Here they are identities, so the model,
    generation and the checkpoint writer run without `torch.distributed` at tp = 1.
    """

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    """Expert parallelism (`moe.GroupedExperts`): MoE experts split over `ep_group`, ranks of the data-parallel group
    that share this rank's tp rank; 1 = every rank holds every expert."""
    ep_rank: int = 0
    ep_group: Group = None

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        """Token embedding: `[B, T]` ids -> `[B, T, dim]`."""
        return Embedding(num_embeddings, dim)

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """`[..., in]` -> `[..., out / tp_size]` (this rank's slice of the output features)."""
        return nn.Linear(in_features, out_features, bias=bias)

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """`[..., in / tp_size]` (this rank's slice) -> `[..., out]`, summed over ranks."""
        return nn.Linear(in_features, out_features, bias=bias)

    def head_norm(self, head_dim: int, eps: float) -> nn.Module:
        """RMSNorm over the last dim of `[..., heads_local, head_dim]` with one `[head_dim]` gain for every head of
        every rank (Qwen3's q_norm / k_norm), replicated on each rank."""
        return RMSNorm(head_dim, eps)

    def vocab_range(self, padded_vocab: int) -> tuple[int, int]:
        """Global rows `[start, end)` of the (padded) vocabulary held by this rank."""
        per_rank = padded_vocab // self.tp_size
        return self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., V_pad / tp]` (this rank's vocab slice) -> `[..., V_pad]`, the same on every tp rank; autograd-aware."""
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """tp rank 0's `x` on every tp rank (same shape and dtype everywhere)."""
        return x

    def gather_to_first(self, shard: torch.Tensor, dim: int) -> Optional[torch.Tensor]:
        """The whole tensor, every rank's `shard` concatenated along `dim`, on tp rank 0; None on the others."""
        return shard


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) (Zhang & Sennrich 2019), normalised in fp32 like HF. Shape-preserving.

    `grad_group`: the tensor-parallel group of a gain that is replicated but sees only this rank's part
    of the input (a per-head norm over this rank's heads): the backward sums the gain's gradient over
    the group (`copy_to_group`), so every rank holds the whole model's gradient, as for the other
    replicated parameters. None (the default): the input is the same on every rank.
    """

    def __init__(self, dim: int, eps: float, grad_group: Group = None):
        super().__init__()
        self.eps = eps
        self.grad_group = grad_group
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight if self.grad_group is None else copy_to_group(self.weight, self.grad_group)
        return weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    """`[head_dim / 2]` fp32 inverse frequencies theta^(-2i/d) (Su et al. 2021), with Llama 3 scaling if given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed fp32 cos/sin tables `[max_position_embeddings, head_dim / 2]`, gathered by position id.

    Positions must be < max_position_embeddings (an index error otherwise). The angle is pos * inv_freq
    in fp32, the same product transformers forms, so the tables agree bit for bit.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        angles = torch.arange(config.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids `[B, T]` -> (cos, sin), each `[B, 1, T, head_dim / 2]` in `dtype` (broadcast over heads)."""
        return self.cos[position_ids].to(dtype)[:, None], self.sin[position_ids].to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves: `[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]` (HF's rotate_half layout). x: `[B, h, T, D]`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class KVCache:
    """Preallocated keys and values of every layer for incremental decoding.

    `k[l]`, `v[l]`: `[B, n_kv_heads_local, max_len, head_dim]`. Slots `[0, length)` are filled; a forward
    of T new tokens writes slots `[length, length + T)` in every layer, then `advance(T)` moves `length`.
    Slot index = token index in the (left-padded) sequence, as in transformers, so sliding windows and
    masks measure the same distances.
    """

    def __init__(self, num_layers: int, batch: int, n_kv_heads_local: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, n_kv_heads_local, max_len, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `[B, h, T, D]` new keys/values of `layer`; return all keys/values so far `[B, h, length + T, D]`."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens


class SlotKVCache:
    """Keys and values of `slots` independent sequences, each decoding at its own column: continuous batching.

    `k[l]`, `v[l]`: `[slots, n_kv_heads_local, max_len, head_dim]`, `valid` `[slots, max_len]` bool (the keys
    each row may attend) and `columns` `[slots]` int64 (the slot each row's next token is written to) are
    allocated once and only ever written in place, so a decode step over them has fixed shapes and reads
    no host value: the condition for CUDA-graph capture. A forward decodes one token for the first B rows
    (`B <= slots`; the caller keeps its live rows in a prefix, `compact`): it marks `valid` at `columns`,
    writes the new key/value there, attends the first `window` slots (a host int: `max_len` for a static
    step, or the caller's bound on the live columns to save work in eager mode) and `advance` moves
    `columns` on by one. A write past `max_len` (a row that finished but still rides along until the
    caller's next check) lands on the last slot, which that row never reads again before it is refilled.
    Slot index = token index of the row's sequence (prompts start at slot 0, no padding inside a row),
    so sliding windows measure the same distances as transformers.
    """

    def __init__(self, num_layers: int, slots: int, n_kv_heads_local: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (slots, n_kv_heads_local, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = torch.zeros(slots, max_len, dtype=torch.bool, device=device)
        self.columns = torch.zeros(slots, dtype=torch.long, device=device)
        # the value `prepare` writes into `valid`, on the device: `valid[rows, cols] = True` would copy a host
        # scalar to the GPU inside the decode step, which CUDA-graph capture refuses (an unpinned host copy)
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self.max_len = max_len
        self.window = max_len

    @property
    def length(self) -> int:
        """Keys before the new token in the attended window (`Decoder.forward`'s offset)."""
        return self.window - 1

    def prepare(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mark the first `batch` rows' new slots valid; (key_valid `[batch, window]`, query slots `[batch, 1]`)."""
        rows = torch.arange(batch, device=self.columns.device)
        self.valid[rows, self.columns[:batch].clamp(max=self.max_len - 1)] = self._true
        return self.valid[:batch, :self.window], self.columns[:batch, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one new key/value `[B, h, 1, D]` per row at its column (in the cache's dtype: under autocast the
        projections give bf16 values and RoPE's fp32 tables promote the keys to fp32); return the window
        `[B, h, window, D]`."""
        b = k.shape[0]
        rows = torch.arange(b, device=k.device)
        cols = self.columns[:b].clamp(max=self.max_len - 1)
        self.k[layer][rows, :, cols] = k[:, :, 0].to(self.k[layer].dtype)
        self.v[layer][rows, :, cols] = v[:, :, 0].to(self.v[layer].dtype)
        return self.k[layer][:b, :, :self.window], self.v[layer][:b, :, :self.window]

    def advance(self, num_tokens: int) -> None:
        self.columns += num_tokens

    def fill(self, rows: torch.Tensor, source: "KVCache", source_rows: torch.Tensor, valid: torch.Tensor) -> None:
        """Rows `rows` `[m]` start from `source`'s rows `source_rows` `[m]` (a prefill cache of W slots, sequences
        starting at slot 0), `valid` `[m, W]` their real tokens; each row's next token goes after its last one."""
        width = valid.shape[1]
        for k, v, src_k, src_v in zip(self.k, self.v, source.k, source.v):
            k[rows, :, :width] = src_k[source_rows, :, :width].to(k.dtype)
            v[rows, :, :width] = src_v[source_rows, :, :width].to(v.dtype)
        self.valid[rows] = False
        self.valid[rows, :width] = valid
        self.columns[rows] = valid.sum(-1)

    def compact(self, keep: torch.Tensor) -> None:
        """Move rows `keep` `[n]` (live rows, ascending) to rows `[0, n)`; the rows after them are free."""
        n = keep.numel()
        for tensor in (*self.k, *self.v, self.valid, self.columns):
            tensor[:n] = tensor[keep]


class Attention(nn.Module):
    """Causal multi-head attention with grouped kv heads (GQA) and RoPE on q and k.

    x `[B, T, H]` -> `[B, T, H]`. Holds `n_heads_local` query heads and `n_kv_heads_local` kv heads
    (the whole model's counts divided by the factory's tp_size). With `config.qk_norm` (Qwen3) each
    q and k head `[head_dim]` is RMS-normalised with the shared gain `q_norm` / `k_norm` after the
    projection and before RoPE, as transformers' Qwen3Attention does.
    """

    def __init__(self, config: ModelConfig, factory: LayerFactory, layer_idx: int):
        super().__init__()
        tp = factory.tp_size  # divisibility checked once by `Decoder` (ModelConfig.check_tensor_parallel)
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.n_heads_local = config.num_attention_heads // tp
        self.n_kv_heads_local = config.num_key_value_heads // tp
        h, d = config.hidden_size, config.head_dim
        self.q_proj = factory.column_linear(h, config.num_attention_heads * d, bias=config.qkv_bias)
        self.k_proj = factory.column_linear(h, config.num_key_value_heads * d, bias=config.qkv_bias)
        self.v_proj = factory.column_linear(h, config.num_key_value_heads * d, bias=config.qkv_bias)
        self.o_proj = factory.row_linear(config.num_attention_heads * d, h, bias=config.o_bias)
        self.q_norm = factory.head_norm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = factory.head_norm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
                kv_cache: Optional[KVCache]) -> torch.Tensor:
        """batch: padding, packing and window of this forward (see `attention.AttentionBatch`)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads_local, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads_local, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads_local, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = causal_attention(q, k, v, batch)
        return self.o_proj(out.reshape(b, t, self.n_heads_local * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020). `[B, T, H]` -> `[B, T, H]`; width default `intermediate_size`."""

    def __init__(self, config: ModelConfig, factory: LayerFactory, width: Optional[int] = None):
        super().__init__()
        h, f = config.hidden_size, width or config.intermediate_size
        self.gate_proj = factory.column_linear(h, f, bias=config.mlp_bias)
        self.up_proj = factory.column_linear(h, f, bias=config.mlp_bias)
        self.down_proj = factory.row_linear(f, h, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). `[B, T, H]` -> `[B, T, H]`.

    `layer_idx` is the layer's index in its module (the KV cache's), `global_idx` in the whole model (which
    layers are MoE layers, the `Routing` keys); they differ in later pipeline stages."""

    def __init__(self, config: ModelConfig, factory: LayerFactory, layer_idx: int, global_idx: Optional[int] = None):
        super().__init__()
        global_idx = layer_idx if global_idx is None else global_idx
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, factory, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(global_idx):
            width = config.shared_expert_intermediate_size
            self.mlp = MoEMLP(config, factory, global_idx, SwiGLU(config, factory, width) if width else None)
        else:
            self.mlp = SwiGLU(config, factory)

    def forward(self, x, cos, sin, batch, kv_cache, routing: Optional[ForwardRouting] = None):
        x = x + self.attn(self.attn_norm(x), cos, sin, batch, kv_cache)
        if isinstance(self.mlp, MoEMLP):
            return x + self.mlp(self.mlp_norm(x), routing)
        return x + self.mlp(self.mlp_norm(x))


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, doc_ids), each `[1, total]`, for documents packed back to back with boundaries `cu_seqlens`.

    cu_seqlens: `[n_docs + 1]` int, 0 = cu_seqlens[0] <= ... <= cu_seqlens[-1] = total (flash-attn's varlen
    convention). Position of token t in document d is t - cu_seqlens[d]. The boundaries are validated on
    the host: one device sync per forward, not per layer.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {total}, got {bounds}")
    tokens = torch.arange(total, device=cu_seqlens.device)
    doc_ids = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    return (tokens - cu_seqlens[doc_ids])[None], doc_ids[None]


class Decoder(nn.Module):
    """Token ids -> final (normed) hidden states. The trunk under every head (LM, value, reward).

    Args:
        config: shapes and numerics.
        factory: builds the embedding and projections (tensor parallelism plugs in here); default tp = 1.
        activation_checkpointing: recompute each layer in backward instead of storing its activations
            (saves ~L x activation memory for ~1 extra forward); only applies in training with gradients and
            without a cache.
        layer_range: `(start, end)`: build only decoder layers `[start, end)` of the config's L, a pipeline
            stage. The embedding exists only when start == 0 (otherwise forward takes the previous stage's
            hidden states) and the final norm only when end == L (otherwise forward returns un-normed hidden
            states for the next stage). Local layer i is global layer start + i (`hf_adapter` maps the names).
            Default: all layers.
    """

    def __init__(self, config: ModelConfig, factory: Optional[LayerFactory] = None,
                 activation_checkpointing: bool = False, layer_range: Optional[tuple[int, int]] = None):
        super().__init__()
        factory = factory or LayerFactory()
        config.check_tensor_parallel(factory.tp_size)
        start, end = layer_range or (0, config.num_hidden_layers)
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"layer_range must satisfy 0 <= start < end <= num_hidden_layers="
                             f"{config.num_hidden_layers}, got {layer_range}")
        self.config = config
        self.factory = factory
        self.activation_checkpointing = activation_checkpointing
        self.layer_range = (start, end)
        self.embed = factory.embedding(config.padded_vocab_size, config.hidden_size) if start == 0 else None
        self.layers = nn.ModuleList(DecoderLayer(config, factory, i, start + i) for i in range(end - start))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if end == config.num_hidden_layers else None
        self.rope = RotaryEmbedding(config)
        self.routing: Optional[Routing] = None  # MoE routing of the current forward (`moe.moe_routing`)

    def new_kv_cache(self, batch: int, max_len: int, dtype: Optional[torch.dtype] = None,
                     slotted: bool = False) -> KVCache | SlotKVCache:
        """An empty cache for `batch` sequences of up to `max_len` tokens (prompt + generated), in this rank's heads;
        `slotted`: a `SlotKVCache` (rows at their own columns) instead of a `KVCache` (rows aligned).

        `dtype` default: the autocast dtype when autocast is on for the weights' device (bf16 compute over fp32
        master weights: attention reads its keys and values in bf16 anyway, so a bf16 cache holds the same values in
        half the memory), else the weights' dtype."""
        attn = self.layers[0].attn
        weight = attn.o_proj.weight
        if dtype is None:
            device_type = weight.device.type
            autocast = device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type) if autocast else weight.dtype
        return (SlotKVCache if slotted else KVCache)(len(self.layers), batch, attn.n_kv_heads_local, max_len,
                                                     attn.head_dim, dtype, weight.device)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """Final hidden states `[B, T, H]` (un-normed when this module ends before the last layer).

        Args:
            input_ids: `[B, T]` token ids (`[1, total]` when packed); for a module without the embedding
                (a later pipeline stage), the previous stage's hidden states `[B, T, H]`.
            attention_mask: `[B, S]` 1 for real tokens, 0 for padding; S = T, or cache length + T with a cache.
            position_ids: `[B, T]`; default: running count of real tokens (cumsum(mask) - 1), packed:
                restart at each document, cache: continue from the cache length.
            cu_seqlens: `[n_docs + 1]` document boundaries of a packed batch (B must be 1; no cache).
            kv_cache: filled with this call's keys/values and advanced by T. A `SlotKVCache` (continuous
                batching) takes one token per row, position_ids and no attention_mask.
        """
        if input_ids.dim() != (2 if self.embed is not None else 3):
            expected = "[batch, seq]" if self.embed is not None else "hidden states [batch, seq, hidden]"
            raise ValueError(f"input_ids must be {expected}, got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape[:2]
        offset = kv_cache.length if kv_cache is not None else 0
        query_slots = None
        if isinstance(kv_cache, SlotKVCache):
            if t != 1 or attention_mask is not None or position_ids is None:
                raise ValueError("a SlotKVCache decodes one token per row: input_ids [B, 1] with position_ids [B, 1] "
                                 "and no attention_mask (the cache holds each row's)")
            attention_mask, query_slots = kv_cache.prepare(b)
        elif kv_cache is not None and offset + t > kv_cache.max_len:
            raise ValueError(f"kv_cache holds {kv_cache.max_len} tokens; {offset} cached + {t} new do not fit")
        if attention_mask is not None and attention_mask.shape != (b, offset + t):
            raise ValueError(f"attention_mask must have shape {(b, offset + t)}, got {tuple(attention_mask.shape)}")
        doc_ids = None
        if cu_seqlens is not None:
            if b != 1 or kv_cache is not None or attention_mask is not None:
                raise ValueError("cu_seqlens needs input_ids of shape [1, total], no attention_mask and no kv_cache")
            packed_pos, doc_ids = packed_positions(cu_seqlens, t)
            position_ids = packed_pos if position_ids is None else position_ids
        key_valid = attention_mask.bool() if attention_mask is not None else None
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, offset:]
            else:
                position_ids = torch.arange(offset, offset + t, device=input_ids.device).expand(b, t)
        batch = AttentionBatch(t, offset + t, key_valid, doc_ids, cu_seqlens, self.config.sliding_window,
                               kv_cache is not None, input_ids.device, query_slots)

        routing = None
        if self.routing is not None:  # the load-balancing statistics count real tokens only, as transformers' do
            routing = self.routing.start_forward(key_valid[:, offset:].reshape(-1) if key_valid is not None else None)
        x = self.embed(input_ids) if self.embed is not None else input_ids
        cos, sin = self.rope(position_ids, x.dtype)
        for layer in self.layers:
            if self.activation_checkpointing and self.training and kv_cache is None and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, batch, None, routing, use_reentrant=False)
            else:
                x = layer(x, cos, sin, batch, kv_cache, routing)
        if kv_cache is not None:
            kv_cache.advance(t)
        return self.norm(x) if self.norm is not None else x
