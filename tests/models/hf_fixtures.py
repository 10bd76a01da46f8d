"""Tiny random HF models saved with `save_pretrained`: the references megalign is compared against."""
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification)

VOCAB = 97  # prime: no accidental alignment with any padding multiple

_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, pad_token_id=0)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# name -> (HF config class, causal-LM class, extra config)
FAMILIES = {
    "llama3_gqa": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters=LLAMA3_ROPE)),
    "llama_bias_mha": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=4, attention_bias=True,
                                                           mlp_bias=True, head_dim=32)),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2_untied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "mistral_window": (MistralConfig, MistralForCausalLM, dict(sliding_window=8, head_dim=16)),
    # Qwen3: per-head q/k norms, no bias, head_dim (24, 32) unlike hidden / heads (16)
    "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3_untied": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=24)),
}

SEQ_CLS = {"llama": (LlamaConfig, LlamaForSequenceClassification), "qwen2": (Qwen2Config, Qwen2ForSequenceClassification),
           "qwen3": (Qwen3Config, Qwen3ForSequenceClassification)}


def _randomise_norms(model):
    """HF initialises RMSNorm weights (and biases) to constants; random ones make the comparison meaningful."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    return model


def make_causal_lm(path, family: str, seed: int = 0, **overrides):
    """Save a random HF causal LM of `family` in `path`; return it in eval mode (fp32, SDPA attention)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**_TINY, **extra, **overrides}))
    _randomise_norms(model).eval().save_pretrained(path)
    return model


def make_seq_cls(path, family: str, seed: int = 0, **overrides):
    """Save a random HF `...ForSequenceClassification` (num_labels=1, pad id 0) in `path`; return it."""
    cfg_cls, model_cls = SEQ_CLS[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**_TINY, **overrides}, num_labels=1))
    _randomise_norms(model).eval().save_pretrained(path)
    return model


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    """Ids in [1, VOCAB): 0 is the pad id, kept out of real tokens so HF's pad-id pooling sees only padding."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, seq), generator=g)
