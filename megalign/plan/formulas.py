"""The published per-rank memory formulas the planner is built from, as plain functions of the sizes.

- Model states per parameter (bytes): Megatron-core's distributed-optimizer table
  (docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html): with d the
  data-parallel size, fp16 params + fp16 grads 20 (4 + 16/d with the distributed optimizer), bf16
  params + fp32 main grads 18 (6 + 12/d), fp32 params + fp32 grads 16 (8 + 8/d). The split into
  (weights, gradients, optimizer) is (2, 2, 16), (2, 4, 12), (4, 4, 8): the distributed optimizer
  shards the third term, which holds the fp32 main weights (where the params are not fp32 already)
  and Adam's two moments. `ZERO` is the ZeRO paper's mixed-precision Adam (Rajbhandari et al. 2020,
  arXiv 1910.02054, Fig. 1: 2 + 2 + K with K = 12), whose stages 1 / 2 / 3 shard the optimizer,
  then the gradients, then the weights over d. `MEGALIGN` is what megalign itself holds
  (`megalign.parallel.precision`): fp32 master weights that are the parameters, fp32 gradients and
  AdamW's two fp32 moments, sharded by ZeRO-1 (`torch`'s ZeroRedundancyOptimizer); bf16 compute
  adds transient bf16 copies of the weights (`CAST_COPY_BYTES`) while the model computes.
- Activations per transformer layer (bytes, 16-bit activations): Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), section 4: sbh(34 + 5as/h)
  without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism t, sbh(34/t + 5as/(ht)) with
  sequence parallelism, sbh * 34/t with selective recomputation (the 5as/h attention-score terms
  recomputed) and 2sbh with full recomputation (only the layer input is kept).
  `korthikanti_layer_bytes` is that count term by term, generalised to the decoders of today: a gated
  (SwiGLU) MLP of width f, grouped kv heads, no dropout, flash attention (no s x s tensors); with
  GPT's shapes (f = 4h, a kv head per query head, dropout, materialised scores) it is the paper's
  formula exactly. `megalign_layer_bytes` counts what megalign's own decoder layer saves for backward
  (its fp32 residual stream and fp32 RMSNorm, one bf16 input cast per projection under autocast), the
  count checked against torch's saved-tensor hooks in tests/plan. An MoE layer is either count with the SwiGLU
  width a token goes through (k experts of moe_intermediate_size, plus a shared expert) and `moe_dispatch_bytes`
  (router probabilities, routing weights, the dispatched rows); a LoRA layer that count plus
  `megalign_lora_delta_bytes`; both exact against saved-tensor hooks (fp32; LoRA in bf16 too).

Sizes: s sequence length, b micro-batch size, h hidden size, a attention heads, t tensor-parallel size.
"""
from __future__ import annotations

from typing import Literal, Optional

Recompute = Literal["none", "selective", "full"]

MEGATRON = {"fp16": (2, 2, 16), "bf16": (2, 4, 12), "fp32": (4, 4, 8)}
"""Megatron-core: (weight, gradient, optimizer) bytes per parameter by param dtype (bf16 with fp32 main grads)."""
MEGATRON_BF16_GRADS = (2, 2, 16)
"""Megatron-core with bf16 params and bf16 main gradients (`grad_reduce_in_fp32: false`): the fp16 row."""
ZERO = (2, 2, 12)
"""ZeRO (arXiv 1910.02054): fp16/bf16 weights and gradients, K = 12 bytes of fp32 master weights and Adam moments."""
MEGALIGN = (4, 4, 8)
"""megalign: fp32 master weights (the parameters), fp32 gradients, AdamW exp_avg and exp_avg_sq in fp32."""
CAST_COPY_BYTES = 2
"""megalign under bf16 autocast: the bf16 copy of every weight that torch's autocast cache holds while computing."""


def state_bytes_per_param(recipe: tuple[int, int, int], dp: int, zero_stage: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter on one rank: ZeRO stage >= 1 shards the
    optimizer over dp, >= 2 also the gradients, 3 also the weights (Megatron's distributed optimizer is stage 1)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    w, g, o = recipe
    return (w / dp if zero_stage >= 3 else w, g / dp if zero_stage >= 2 else g, o / dp if zero_stage >= 1 else o)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                            recompute: Recompute = "none", ffn: Optional[int] = None, gated: bool = False,
                            kv_heads: Optional[int] = None, dropout: bool = True, flash: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, section 4.1).

    Terms in units of sbh bytes (16-bit activations, 1-byte dropout masks), r = ffn / h, g = kv_heads / a:
    replicated over the tp group (split by t only with sequence parallelism): the two LayerNorm inputs
    (4), the inputs of the QKV and first MLP projections (2 + 2) and the two dropout masks (1 + 1);
    split by t: Q and K (2 + 2g), V (2g), the output projection's input (2), the MLP's inner
    activations (2r + 2r for GeLU's input and output; 4r + 2r for a gated MLP's two halves and the
    product); split by t, per attention score: softmax output, its dropout mask and the dropout output
    (5as/h), absent with flash attention, which recomputes them. GPT's shapes give 10 + 24/t + 5as/(ht).
    Selective recomputation drops the score terms; full recomputation keeps only the layer input (2).
    """
    ffn = 4 * h if ffn is None else ffn
    kv_heads = a if kv_heads is None else kv_heads
    r, g = ffn / h, kv_heads / a
    if recompute == "full":
        return s * b * h * (2 / t if sequence_parallel else 2)
    replicated = 4 + 2 + 2 + (2 if dropout else 0)
    split = (2 + 2 * g) + 2 * g + 2 + ((4 * r + 2 * r) if gated else (2 * r + 2 * r))
    scores = 0.0 if (flash or recompute == "selective") else (5 if dropout else 2) * a * s / h
    return s * b * h * ((replicated / t if sequence_parallel else replicated) + split / t + scores / t)


def megalign_layer_bytes(s: int, b: int, h: int, a: int, kv_heads: int, ffn: int, t: int = 1,
                         compute_bytes: int = 4, attention: Literal["flash", "sdpa"] = "flash",
                         recompute: Recompute = "none", head_dim: Optional[int] = None, qk_norm: bool = False) -> float:
    """Bytes megalign's `DecoderLayer` saves for backward, per micro-batch of b sequences of s tokens.

    megalign keeps fp32 master weights, so the embedding output and the residual stream are fp32 even
    under bf16 autocast (compute_bytes = 2). Per token, with e = compute_bytes, g = kv_heads / a:
    each RMSNorm saves its fp32 input and its fp32 normalised value (8h) and the fp32 rsqrt (4);
    the projections save their input: shared by q/k/v and by gate/up in fp32 (4h + 4h), one bf16 cast
    per projection under autocast (3 * 2h + 2 * 2h); with q = a d and kv = kv_heads d the widths of the
    queries and of the keys (d = head_dim, h / a unless given), attention saves q, k, v, its output
    (e (2q + 2kv) / t) and the log-sum-exp (4a / t), and the output projection a contiguous copy of the
    output (e q / t); Qwen3's per-head q/k norms (`qk_norm`) save their fp32 input and their normalised
    value ((4 + e)(q + kv) / t) and one fp32 rsqrt per head (4 (a + kv_heads) / t); the SwiGLU saves
    gate, up, silu(gate) and the product (4 e f / t). SDPA over a padded batch (no flash-attn: CPU, or
    the package missing) also saves the additive [b, 1, s, s] mask in e bytes.
    Full recomputation (`torch.utils.checkpoint` per layer) keeps only the fp32 layer input (4h); the
    layer being recomputed is counted by the caller.
    """
    tokens = s * b
    if recompute == "full":
        return tokens * 4 * h
    e = compute_bytes
    norms = 2 * (8 * h + 4)
    inputs = 8 * h if e == 4 else (3 + 2) * 2 * h
    q = a * (h // a if head_dim is None else head_dim)
    kv = q * kv_heads // a
    attn = (e * (2 * q + 2 * kv) + 4 * a + e * q) / t
    if qk_norm:
        attn += ((4 + e) * (q + kv) + 4 * (a + kv_heads)) / t
    mlp = 4 * e * ffn / t
    mask = b * s * s * e if attention == "sdpa" else 0
    return tokens * (norms + inputs + attn + mlp) + mask


def megalign_lora_delta_bytes(tokens: int, h: int, q: int, kv: int, ffn: int, targets: set, rank: int, t: int = 1,
                              compute_bytes: int = 4, qk_norm: bool = False) -> float:
    """What megalign's `DecoderLayer` saves under LoRA minus what `megalign_layer_bytes` counts for it (negative:
    LoRA saves less). With q = a d and kv = kv_heads d the attention widths, e = compute_bytes, per token:

    a frozen weight's matmul does not save its input (autograd keeps what the gradients it needs require), and a
    frozen RMSNorm gain not the normalised value: minus the two norms' normalised values (8h), the per-head q/k
    norms' (e (q + kv) / t), the projections' inputs (fp32: 8h; bf16: one cast per projection, 5 x 2h), the output
    projection's input copy (e q / t) and the SwiGLU product, the down projection's input (e f / t); plus, per
    adapted linear, the input its A matmul saves (fp32: shared by q / k / v, and by gate / up, as the full count's;
    bf16: one cast each, of its local input: h for q / k / v / gate / up, q / t for o, f / t for down) and the
    [tokens, r] product x A^T its B matmul saves (e r). Checked against saved-tensor hooks (tests/plan)."""
    e = compute_bytes
    removed = 8 * h + (e * (q + kv) / t if qk_norm else 0) + (8 * h if e == 4 else 5 * 2 * h) + e * q / t + e * ffn / t
    width = {"q_proj": h, "k_proj": h, "v_proj": h, "gate_proj": h, "up_proj": h, "o_proj": q / t, "down_proj": ffn / t}
    adapted = [name for name in width if name in targets]
    if e == 4:  # q / k / v share one fp32 input, gate / up another
        groups = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",)]
        inputs = sum(4 * width[g[0]] for g in groups if any(name in targets for name in g))
    else:
        inputs = sum(e * width[name] for name in adapted)
    return tokens * (inputs + e * rank * len(adapted) - removed)


def moe_dispatch_bytes(tokens: int, h: int, num_experts: int, top_k: int, compute_bytes: int, split: int = 1) -> float:
    """What an MoE layer of `megalign.models.moe` saves for backward beyond a SwiGLU of width k x moe_intermediate_size
    (which `megalign_layer_bytes` counts with ffn = k F), per token: the router's fp32 probabilities (4E: softmax
    saves its output), the top-k expert ids (int64, 8k), the top-k weights, their sum and the renormalised weights
    (fp32, 4k + 4 + 4k), the two int64 permutations of the k dispatched rows (16k), the dispatched rows of the input
    (e k h: the grouped matmul's input) and the experts' outputs, cast to fp32 for the weighted combine (4 k h).
    Checked against saved-tensor hooks in fp32 (tests/plan/test_plan_moe_lora.py); e is the experts' compute dtype
    (the autocast dtype, bf16, on CPU and CUDA alike: `torch._grouped_mm` is not on autocast's cast list, so
    `GroupedExperts` casts its operands itself; fp32 without autocast). `split`: ranks the tokens are split over (Megatron's sequence parallelism with expert tp 1:
    tp); 1 where every tp rank routes all of them (megalign). Megatron's dropless dispatcher saves the same kinds."""
    return tokens * (4 * num_experts + 32 * top_k + 4 + (compute_bytes + 4) * top_k * h) / split


def pipeline_in_flight(pp: int, stage: int, n_microbatches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B: min(pp - stage, n)
    (Narayanan et al. 2021, arXiv 2104.04473, section 2.2.1: warm-up forwards then one forward per backward)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    return max(1, min(pp - stage, n_microbatches))


def gib(n_bytes: float) -> float:
    return n_bytes / 2 ** 30


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["MEGATRON", "MEGATRON_BF16_GRADS", "ZERO", "MEGALIGN", "CAST_COPY_BYTES", "state_bytes_per_param",
           "korthikanti_layer_bytes", "megalign_layer_bytes", "megalign_lora_delta_bytes", "moe_dispatch_bytes",
           "pipeline_in_flight", "gib", "ceil_div"]
