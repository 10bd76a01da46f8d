"""The model side of the planner: published architectures (presets), HF config.json, and parameter counts per rank.

A model is a `megalign.models.ModelConfig` (the same object the decoders are built from), so a preset,
an HF `config.json` and a megalign checkpoint are read one way. Parameter counts follow megalign's
decoder exactly (`megalign.models.decoder`): per layer the q/k/v/o projections (GQA: k and v have
num_key_value_heads heads of head_dim), the three SwiGLU matrices h x f, two RMSNorm gains, Qwen3's
two per-head q/k norm gains (head_dim each), and the biases the family has (Qwen2: q/k/v); the
embedding and the LM head are padded_vocab x h each (one matrix when tied), the final norm h. Under
tensor parallelism a rank holds 1/t of every projection, of the vocabulary rows and of the
column-parallel biases, and whole copies of the norms (the q/k norms too) and of the row-parallel
biases. A pipeline stage holds its layers (L / pp each, or an uneven split: `StageSplit`, Megatron's
first / last stage layer counts or a list), the embedding on the first stage, the final
norm and the head on the last (a tied head is a copy on the last stage when pp > 1, as Megatron).

Mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE; `ModelConfig.is_moe_layer` says which layers): an MoE
layer's MLP is a router h x E (replicated over tp, as `megalign.models.moe.MoEMLP`), E experts of three
h x moe_intermediate_size matrices, and Qwen2-MoE's shared expert (a SwiGLU of width
shared_expert_intermediate_size, sliced by tp, and its h x 1 sigmoid gate, replicated); the other layers
(mlp_only_layers, or off the decoder_sparse_step) keep the dense SwiGLU. Expert parallelism (Megatron's
expert_model_parallel_size ep, with expert tensor parallelism etp: tp unless given) puts E / ep experts on a
rank, each sliced by etp; `StageParams.experts` counts them apart, because their states are sharded over the
expert data-parallel group (`megalign.plan.planner`). `active_params` is a token's count: every non-expert
parameter and k of the E experts of each MoE layer (the "A3B" of a model card).

LoRA (`megalign.models.lora`): `lora_layer_params` counts the adapters one rank holds on one layer, r x (in + out)
per target linear, split the Megatron way (column: A [r, in] replicated, B [out / tp, r]; row: A [r, in / tp],
B [out, r] replicated); the stacked experts and the router get none, a shared expert's linears do.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from megalign.models.config import ModelConfig
from megalign.models.lora import LoRAConfig
from megalign.models.parallelize import tensor_parallel_config
from megalign.parallel.layout import StageSplit


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> ModelConfig:
    """A Qwen3 dense checkpoint: what its sizes share (151936 ids, 8 kv heads of head_dim 128 whatever the width,
    so 0.6B's 16 query heads span 2048 over h = 1024; RoPE theta 1e6, 40960 positions); tied below 4B."""
    return ModelConfig("qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=tied, rope_theta=1000000.0, max_position_embeddings=40960)


# The published architectures (the config.json of each checkpoint on the Hugging Face hub).
PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig("llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-5,
                             max_position_embeddings=4096),
    "llama2-13b": ModelConfig("llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                              num_attention_heads=40, num_key_value_heads=40, head_dim=128, rms_norm_eps=1e-5,
                              max_position_embeddings=4096),
    "llama2-70b": ModelConfig("llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                              max_position_embeddings=4096),
    "llama3-8b": ModelConfig("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                             rope_theta=500000.0, max_position_embeddings=8192),
    "llama3-70b": ModelConfig("llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                              rope_theta=500000.0, max_position_embeddings=8192),
    "qwen2.5-7b": ModelConfig("qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4, head_dim=128, qkv_bias=True,
                              rope_theta=1000000.0, max_position_embeddings=32768),
    "qwen2.5-72b": ModelConfig("qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                               num_attention_heads=64, num_key_value_heads=8, head_dim=128, qkv_bias=True,
                               rope_theta=1000000.0, max_position_embeddings=32768),
    "qwen3-0.6b": _qwen3(hidden=1024, intermediate=3072, layers=28, heads=16, tied=True),
    "qwen3-1.7b": _qwen3(hidden=2048, intermediate=6144, layers=28, heads=16, tied=True),
    "qwen3-8b": _qwen3(hidden=4096, intermediate=12288, layers=36, heads=32, tied=False),
    "qwen3-32b": _qwen3(hidden=5120, intermediate=25600, layers=64, heads=64, tied=False),
    "qwen3-30b-a3b": ModelConfig("qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                 rope_theta=1000000.0, max_position_embeddings=40960, num_experts=128,
                                 num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "qwen3-235b-a22b": ModelConfig("qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                   num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                                   rope_theta=1000000.0, max_position_embeddings=40960, num_experts=128,
                                   num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True),
    "mixtral-8x7b": ModelConfig("mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768, num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True),
}


def load_model(spec: Union[str, os.PathLike, dict]) -> ModelConfig:
    """A preset name (`PRESETS`), an HF config dict, a config.json path or a checkpoint folder holding one."""
    if isinstance(spec, dict):
        return ModelConfig.from_hf(spec)
    key = str(spec).lower()
    if key in PRESETS:
        return PRESETS[key]
    if not os.path.exists(spec):
        raise FileNotFoundError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                                f"config.json or checkpoint folder")
    return ModelConfig.from_hf(spec)


@dataclasses.dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds for one pipeline stage at tensor-parallel size tp (counts, not bytes)."""

    layers: int
    """decoder layers on this stage"""
    layer_params: int
    """this rank's parameters of those layers (its routed experts included)"""
    embedding: int
    """this rank's embedding rows x h (first stage only)"""
    head: int
    """this rank's LM-head rows x h plus the final norm (last stage only; 0 for a tied head at pp = 1, counted in embedding)"""
    experts: int = 0
    """of layer_params, this rank's routed-expert parameters (E / ep experts of each MoE layer, sliced by etp)"""

    @property
    def total(self) -> int:
        return self.layer_params + self.embedding + self.head


def _swiglu(cfg: ModelConfig, width: int, tp: int) -> int:
    """A SwiGLU of width `width` on one rank: gate / up (column) and down (row) sliced by tp, the down bias whole."""
    bias = cfg.hidden_size if cfg.mlp_bias else 0
    return (3 * cfg.hidden_size * width + (2 * width if cfg.mlp_bias else 0)) // tp + bias


def expert_params(cfg: ModelConfig, ep: int = 1, etp: int = 1) -> int:
    """One MoE layer's routed experts on one rank: E / ep experts of three h x moe_intermediate_size matrices / etp."""
    return cfg.num_experts // ep * 3 * cfg.hidden_size * cfg.moe_intermediate_size // etp


def layer_params(cfg: ModelConfig, tp: int, layer: Optional[int] = None, ep: int = 1, etp: Optional[int] = None) -> int:
    """One decoder layer's parameters on one tensor-parallel rank (see the module docstring): global layer `layer`
    (None: an MoE layer of an MoE model, the heaviest kind), its E / ep experts sliced by etp (None: tp)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    column = h * (q + 2 * kv) + (q + 2 * kv if cfg.qkv_bias else 0)
    row = q * h
    replicated = 2 * h + (2 * d if cfg.qk_norm else 0) + (h if cfg.o_bias else 0)
    attention = (column + row) // tp + replicated
    moe = cfg.num_experts > 0 if layer is None else cfg.is_moe_layer(layer)
    if not moe:
        return attention + _swiglu(cfg, cfg.intermediate_size, tp)
    shared = cfg.shared_expert_intermediate_size
    mlp = h * cfg.num_experts + expert_params(cfg, ep, tp if etp is None else etp)
    return attention + mlp + ((_swiglu(cfg, shared, tp) + h) if shared else 0)


def active_params(cfg: ModelConfig) -> int:
    """Parameters a token uses: all of them but the E - k experts it is not routed to in each MoE layer."""
    unused = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total_params(cfg) - unused * sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def lora_layer_params(cfg: ModelConfig, lora: LoRAConfig, tp: int, layer: Optional[int] = None) -> int:
    """Adapter parameters one tensor-parallel rank holds on global layer `layer` (None: an MoE layer of an MoE
    model): r (in + out) per target linear, split the Megatron way (module docstring); an MoE layer's MLP linears
    are its shared expert's (none without one)."""
    h, r = cfg.hidden_size, lora.rank
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    moe = cfg.num_experts > 0 if layer is None else cfg.is_moe_layer(layer)
    f = cfg.shared_expert_intermediate_size if moe else cfg.intermediate_size
    column = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "gate_proj": (h, f), "up_proj": (h, f)}
    row = {"o_proj": (q, h), "down_proj": (f, h)}
    total = 0
    for name in lora.modules():
        if name in column and column[name][1]:
            n_in, n_out = column[name]
            total += r * n_in + n_out // tp * r
        elif name in row and row[name][0]:
            n_in, n_out = row[name]
            total += r * n_in // tp + n_out * r
    return total


def padded_vocab(cfg: ModelConfig, tp: int) -> int:
    """Rows of the embedding and the head: the vocabulary padded to lcm(vocab_pad_multiple, tp) (`tensor_parallel_config`)."""
    return tensor_parallel_config(cfg, tp).padded_vocab_size


def stage_layers(num_layers: int, pp: int, split: Optional[StageSplit] = None) -> list[int]:
    """Layers per stage as megalign splits them (`megalign.parallel.pipeline.stage_layer_range`): `split`'s (uneven
    stages), else L / pp each; ValueError naming the options when pp does not divide L and no split is given."""
    return (split or StageSplit()).sizes(num_layers, pp)


def stage_params(cfg: ModelConfig, tp: int, pp: int, stage: int, head: bool = True,
                 split: Optional[StageSplit] = None, ep: int = 1, etp: Optional[int] = None,
                 lora: Optional[LoRAConfig] = None) -> StageParams:
    """This rank's parameters on pipeline stage `stage` (0-based); `head=False` for a trunk with a scalar head
    (value or reward model: the head is h x 1, counted, instead of the LM head); `split` as in `stage_layers`;
    ep / etp: expert parallelism (module docstring); `lora`: count the adapters of those layers instead."""
    tensor_parallel_config(cfg, tp)  # heads, kv heads and SwiGLU width must divide tp (raises naming them)
    sizes = stage_layers(cfg.num_hidden_layers, pp, split)
    first_layer, layers = sum(sizes[:stage]), sizes[stage]
    span = range(first_layer, first_layer + layers)
    if lora is not None:
        return StageParams(layers, sum(lora_layer_params(cfg, lora, tp, i) for i in span), 0, 0)
    rows = padded_vocab(cfg, tp) // tp
    embedding = rows * cfg.hidden_size if stage == 0 else 0
    last = stage == pp - 1
    if not last:
        head_params = 0
    elif not head:
        head_params = cfg.hidden_size + cfg.hidden_size
    else:
        tied_here = cfg.tie_word_embeddings and pp == 1
        head_params = cfg.hidden_size + (0 if tied_here else rows * cfg.hidden_size)
    experts = expert_params(cfg, ep, tp if etp is None else etp) * sum(cfg.is_moe_layer(i) for i in span)
    return StageParams(layers, sum(layer_params(cfg, tp, i, ep, etp) for i in span), embedding, head_params, experts)


def total_params(cfg: ModelConfig) -> int:
    """All parameters of the unsharded model (the count a model card gives)."""
    return stage_params(cfg, 1, 1, 0).total
