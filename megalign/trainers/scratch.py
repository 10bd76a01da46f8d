"""From-scratch policies of the supervised trainers (`model.path: null`): the `ModelConfig` from `PolicyModelConfig`'s
fields and the tokenizer, and a model initialised dense from a seed and sliced to this rank's tp shards and pipeline
stage, so a tiny model starts from the same weights at any layout (`megalign.trainers.supervised` module doc).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from megalign.data import Tokenizer
from megalign.models import CausalLM, ModelConfig, TensorParallelFactory, tensor_parallel_config
from megalign.parallel import ParallelLayout, pp_tied_parameters, stage_layer_range, tp_sharded_parameters

if TYPE_CHECKING:  # the config class lives with the trainer that reads it
    from megalign.trainers.supervised import PolicyModelConfig


def scratch_config(cfg: PolicyModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The `ModelConfig` of a from-scratch model for `tokenizer` (also read by `megalign.plan`)."""
    return ModelConfig(
        model_type=cfg.model_type, vocab_size=tokenizer.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, pad_token_id=tokenizer.pad_id,
        extra_hf={"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id},
    )


def scratch_model(cfg: PolicyModelConfig, tokenizer: Tokenizer, layout: ParallelLayout, seed: int) -> CausalLM:
    """A from-scratch `CausalLM` for `tokenizer`, initialised identically for every tp and pp (module doc): this
    rank's tp slices of its pipeline stage's layers (`stage_layer_range`) of the one dense initialisation; a tied
    LM-head copy on the last stage starts as the embedding."""
    dense_config = scratch_config(cfg, tokenizer)
    config = tensor_parallel_config(dense_config, layout.tp)
    generator = torch.Generator().manual_seed(seed)
    # unpadded: the draws do not depend on tp's vocabulary padding
    dense = CausalLM(dense_config, activation_checkpointing=cfg.activation_checkpointing)
    with torch.no_grad():
        for p in dense.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, cfg.init_std, generator=generator)
    if layout.tp == 1 and layout.pp == 1 and config.padded_vocab_size == dense_config.padded_vocab_size:
        return dense.to(layout.device)
    start, end = stage_layer_range(config.num_hidden_layers, layout)
    model = CausalLM(config, TensorParallelFactory(layout), cfg.activation_checkpointing, layer_range=(start, end))
    shard_dims = {id(p): dim for p, dim in tp_sharded_parameters(model).items()}
    copies = {id(p) for p, is_copy in pp_tied_parameters(model).items() if is_copy}
    full = dict(dense.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            global_name = re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{int(m[1]) + start}.", name)
            src = full["model.embed.weight" if id(p) in copies else global_name]
            if id(p) in shard_dims:
                dim = shard_dims[id(p)]
                padded = src.new_zeros(p.shape[:dim] + (p.shape[dim] * layout.tp,) + p.shape[dim + 1:])
                padded[tuple(slice(0, n) for n in src.shape)] = src  # vocabulary padding rows stay 0, as when loaded
                src = padded.chunk(layout.tp, dim=dim)[layout.tp_rank]
            p.copy_(src)
    return model.to(layout.device)
