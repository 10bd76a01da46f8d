"""Decoder family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral; Qwen2-MoE, Qwen3-MoE and Mixtral), its heads, and HF checkpoint interop.

`from_pretrained(path, kind)` builds a policy ('causal_lm'), critic ('value') or reward model ('reward')
from an HF folder; `save_hf_checkpoint` writes one back. `apply_lora` (lora.py) adds LoRA adapters. `LayerFactory` is where tensor parallelism plugs in;
`TensorParallelFactory` (parallelize.py) is the tensor-parallel one (`from_pretrained(path, layout=...)`).
MoE layers (moe.py): `moe_routing(model, record=..., replay=..., aux=...)` records or forces the experts of
a forward and collects the statistics of `load_balancing_loss`.
`batch_invariant` (or `MEGALIGN_BATCH_INVARIANT=1`): rollout log-probs equal to the trainer's bit for bit.
"""
from . import batch_invariant
from .config import ModelConfig, RopeScaling, hf_architecture
from .decoder import Decoder, KVCache, LayerFactory, SlotKVCache
from .heads import CausalLM, LMHead, RewardHead, RewardModel, ValueHead, ValueModel
from .hf_adapter import (from_pretrained, load_hf_weights, save_hf_checkpoint, scalar_head_from_pretrained,
                         stage_from_pretrained)
from .lora import (LoRAConfig, adapters_disabled, apply_lora, lora_modules, lora_state_dict, merge_adapters,
                   unmerge_adapters)
from .moe import Routing, load_balancing_loss, moe_routing, routing_agreement
from .parallelize import TensorParallelFactory, tensor_parallel_config

if batch_invariant.env_switch():  # MEGALIGN_BATCH_INVARIANT=1: the mode for the whole process (batch_invariant.py)
    batch_invariant.set_batch_invariant(True)

__all__ = [
    "ModelConfig", "RopeScaling", "hf_architecture", "Decoder", "KVCache", "SlotKVCache", "LayerFactory", "CausalLM", "LMHead",
    "RewardHead", "RewardModel", "ValueHead", "ValueModel", "from_pretrained", "load_hf_weights", "save_hf_checkpoint",
    "scalar_head_from_pretrained", "stage_from_pretrained",
    "TensorParallelFactory", "tensor_parallel_config",
    "Routing", "load_balancing_loss", "moe_routing", "routing_agreement",
    "LoRAConfig", "apply_lora", "adapters_disabled", "lora_modules", "lora_state_dict", "merge_adapters", "unmerge_adapters",
]
