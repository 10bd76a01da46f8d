"""Tensor parallelism for the decoder family, kept apart from the model (torchtitan's `parallelize.py`).

The model code (`decoder.py`, `heads.py`) builds every embedding and projection through a
`LayerFactory` and never names a process group. `TensorParallelFactory(layout)` is the factory that
makes the same model tensor-parallel over `layout.tp_group`; `from_pretrained(path, layout=...)`
uses it. Design choices:

- Megatron's split. q/k/v and gate/up are `ColumnParallelLinear` (output features split, not
  gathered), o and down are `RowParallelLinear` (input split, output all-reduced): one all-reduce per
  attention block and one per MLP in the forward. The backward all-reduces the input gradient of each
  column-parallel projection separately (q, k, v, gate, up: five per layer, where Megatron's fused
  qkv and gate/up weights need two); fusing them would change the parameter layout the HF adapter
  slices, so it waits for a measured need. Each rank holds whole
  heads: query heads [r * n_h / tp, (r + 1) * n_h / tp) and kv heads [r * n_kv / tp, ...), which keeps
  each query head with its GQA kv head (HF orders query heads grouped by kv head), so attention and
  the KV cache are purely rank-local.
- Qwen3's q/k norms. HF stores one `[head_dim]` gain for all heads (`q_norm`, `k_norm`); every rank
  holds it whole (replicated, read unsliced) and applies it to its own heads. Its gradient on a rank
  covers that rank's heads only, so the backward sums it over the tp group (`RMSNorm(grad_group=...)`,
  HF's `replicated_with_grad_allreduce`): after the backward it is whole and equal on every rank, and
  the grad norm counts it once like any replicated parameter.
- Vocabulary. The embedding is a `VocabParallelEmbedding` and the LM head a `ColumnParallelLinear`
  over the same rows, so a tied LM head shares its shard with the embedding (split into pipeline stages,
  the last stage's head holds a copy of the same rows, see `heads`). The vocabulary is padded
  Megatron-style to a multiple of `lcm(vocab_pad_multiple, tp)` (`tensor_parallel_config`): pass
  `vocab_pad_multiple=128 * tp` for Megatron's 128-row alignment per rank. Padding rows are zero
  when loaded, get logit -inf (`LMHead`), so they never receive probability, and are dropped on save.
- Logits stay vocab-sharded `[..., V_pad / tp]`: the vocab-parallel log-prob consumes them
  directly. `LMHead.gather_logits` (the factory's `gather_vocab`) gathers the full vocabulary only
  where it is needed: sampling during generation and parity tests.
- Checkpoints. `load_hf_weights` reads only this rank's slices of each safetensors tensor;
  `save_hf_checkpoint` gathers the shards on tp rank 0 (`gather_to_first`), which writes.
- Failing early: `ModelConfig.check_tensor_parallel` runs before any weight exists and names every
  size (heads, kv heads, SwiGLU width, padded vocabulary) that tp does not divide.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from megalign.parallel.collectives import broadcast_from_first, gather_from_group, gather_to_first
from megalign.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megalign.parallel.layout import ParallelLayout

from .config import ModelConfig
from .decoder import LayerFactory, RMSNorm


def tensor_parallel_config(config: ModelConfig, tp: int) -> ModelConfig:
    """`config` with the vocabulary padded so it splits evenly over `tp` ranks; checked for tp (see module doc).

    The padding multiple becomes `lcm(config.vocab_pad_multiple, tp)`: unchanged when it already
    is a multiple of tp (e.g. 128 * tp), so the padded vocabulary is the one the caller asked for.
    """
    config = dataclasses.replace(config, vocab_pad_multiple=math.lcm(config.vocab_pad_multiple, tp))
    config.check_tensor_parallel(tp)
    return config


class TensorParallelFactory(LayerFactory):
    """Builds the model's layers as Megatron tensor-parallel shards over `layout.tp_group`.

    Every rank of a tp group builds the same model with the same config; each holds its shard only
    (the layers' `tp_shard_dims` name the split dimension for clipping and checkpoints). An MoE model's experts
    are split over `layout.ep_group` when `layout.ep` > 1 (`moe.GroupedExperts`). At
    `layout.tp == 1` the layers hold whole weights and issue no collective, so the same code serves
    pure data parallelism.
    """

    def __init__(self, layout: ParallelLayout):
        self.layout = layout
        self.group = layout.tp_group
        self.tp_size = layout.tp
        self.tp_rank = layout.tp_rank
        self.ep_size, self.ep_rank, self.ep_group = layout.ep, layout.ep_rank, layout.ep_group  # MoE experts split

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        """`[B, T]` ids -> `[B, T, dim]`, replicated; this rank holds rows `vocab_range(num_embeddings)`."""
        return VocabParallelEmbedding(num_embeddings, dim, group=self.group)

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return ColumnParallelLinear(in_features, out_features, group=self.group, bias=bias)

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return RowParallelLinear(in_features, out_features, group=self.group, bias=bias)

    def head_norm(self, head_dim: int, eps: float) -> nn.Module:
        return RMSNorm(head_dim, eps, grad_group=self.group)

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_group(x, self.group)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        return broadcast_from_first(x, self.group)

    def gather_to_first(self, shard: torch.Tensor, dim: int) -> Optional[torch.Tensor]:
        return gather_to_first(shard, dim, self.group)
