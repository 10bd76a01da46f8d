"""ModelConfig from HF config.json: both rope spellings, per-family biases, and the errors' wording."""
import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from megalign.models import ModelConfig, RopeScaling, hf_architecture

_TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def test_rope_parameters_and_legacy_rope_scaling_agree():
    modern = LlamaConfig(**_TINY, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}).to_dict()
    assert "rope_parameters" in modern and "rope_scaling" not in modern
    legacy = {k: v for k, v in modern.items() if k != "rope_parameters"}
    legacy.update(rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    a, b = ModelConfig.from_hf(modern), ModelConfig.from_hf(legacy)
    assert a == b
    assert a.rope_theta == 5e5 and a.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


def test_family_biases_window_and_head_dim():
    qwen = ModelConfig.from_hf(Qwen2Config(**_TINY).to_dict())
    assert (qwen.qkv_bias, qwen.o_bias, qwen.sliding_window, qwen.head_dim) == (True, False, None, 16)
    mistral = ModelConfig.from_hf(MistralConfig(**_TINY, sliding_window=32, head_dim=8).to_dict())
    assert (mistral.qkv_bias, mistral.sliding_window, mistral.head_dim) == (False, 32, 8)
    llama = ModelConfig.from_hf(LlamaConfig(**_TINY, attention_bias=True).to_dict())
    assert (llama.qkv_bias, llama.o_bias, llama.rope_scaling) == (True, True, None)


def test_qwen3_norms_bias_and_head_dim():
    qwen3 = ModelConfig.from_hf(Qwen3Config(**_TINY, head_dim=24).to_dict())
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias, qwen3.head_dim, qwen3.sliding_window) == (True, False, False, 24, None)
    biased = ModelConfig.from_hf(Qwen3Config(**_TINY, attention_bias=True).to_dict())
    assert (biased.qkv_bias, biased.o_bias, biased.head_dim) == (True, True, 128)  # Qwen3Config's own default head_dim
    assert not ModelConfig.from_hf(Qwen2Config(**_TINY).to_dict()).qk_norm
    for cfg in (qwen3, biased):
        hf = cfg.to_hf()
        assert (hf["architectures"], hf["attention_bias"], hf["use_sliding_window"]) == (["Qwen3ForCausalLM"],
                                                                                        cfg.qkv_bias, False)
        assert ModelConfig.from_hf(hf) == cfg
    assert hf_architecture("qwen3", "TokenClassification") == "Qwen3ForTokenClassification"


def test_to_hf_round_trips():
    cfg = ModelConfig.from_hf(MistralConfig(**_TINY, sliding_window=32).to_dict(), vocab_pad_multiple=64)
    again = ModelConfig.from_hf(cfg.to_hf(), vocab_pad_multiple=64)
    assert again == cfg and cfg.padded_vocab_size == 128


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    bad_heads = LlamaConfig(**{**_TINY, "num_key_value_heads": 3}).to_dict()
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by num_key_value_heads \(3\)"):
        ModelConfig.from_hf(bad_heads)
    with pytest.raises(ValueError, match="head_dim must be even for RoPE, got 15"):
        ModelConfig.from_hf({**LlamaConfig(**_TINY).to_dict(), "head_dim": 15})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        ModelConfig.from_hf({**LlamaConfig(**_TINY).to_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(Qwen2Config(**_TINY, use_sliding_window=True, sliding_window=16).to_dict())
    with pytest.raises(ValueError, match="^qwen3 with use_sliding_window"):
        ModelConfig.from_hf(Qwen3Config(**_TINY, use_sliding_window=True, sliding_window=16).to_dict())
    with pytest.raises(ValueError, match=r"qwen3's one attention_bias switch .* qkv_bias=True, o_bias=False"):
        ModelConfig(model_type="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, qkv_bias=True)
