"""The planner's formula tables against hand-worked numbers from their sources.

- Megatron-core's distributed-optimizer table (docs.nvidia.com/megatron-core/developer-guide/latest/
  api-guide/dist_optimizer.html): bytes per parameter 20 / 4 + 16/d (fp16 params and grads),
  18 / 6 + 12/d (bf16 params, fp32 grads), 16 / 8 + 8/d (fp32).
- Korthikanti et al. 2022 (arXiv 2205.05198), section 4: sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)),
  sbh(34/t + 5as/(ht)) with sequence parallelism, 34sbh/t selective, 2sbh full recomputation; worked
  here for GPT-3 175B's layer (s = 2048, h = 12288, a = 96, b = 1) as in the paper's Table 2 setting.
- Parameter counts of the presets against the published counts (the models' safetensors index sizes).
- 1F1B in-flight micro-batches (Narayanan et al. 2021): stage s of pp keeps pp - s.
"""
import json

import pytest

from megalign.models import CausalLM, ModelConfig
from megalign.plan.formulas import (MEGATRON, MEGATRON_BF16_GRADS, ZERO, korthikanti_layer_bytes, pipeline_in_flight,
                                    state_bytes_per_param)
from megalign.plan.model import PRESETS, load_model, stage_params, total_params


@pytest.mark.parametrize("dtype, plain, sharded", [("fp16", 20, lambda d: 4 + 16 / d), ("bf16", 18, lambda d: 6 + 12 / d),
                                                   ("fp32", 16, lambda d: 8 + 8 / d)])
def test_megatron_distributed_optimizer_table(dtype, plain, sharded):
    recipe = MEGATRON_BF16_GRADS if dtype == "fp16" else MEGATRON[dtype]
    assert sum(state_bytes_per_param(recipe, 8, zero_stage=0)) == plain
    for d in (1, 2, 8, 64):
        assert sum(state_bytes_per_param(recipe, d, zero_stage=1)) == pytest.approx(sharded(d), rel=1e-15)


def test_zero_paper_stages():
    # ZeRO (arXiv 1910.02054) Figure 1: 7.5B params, Nd = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    psi, nd = 7.5e9, 64
    got = [sum(state_bytes_per_param(ZERO, nd, stage)) * psi / 1e9 for stage in (0, 1, 2, 3)]
    assert got == pytest.approx([120.0, 31.4, 16.6, 1.9], abs=0.05)


S, H, A = 2048, 12288, 96  # GPT-3 175B


def test_korthikanti_no_parallelism():
    # sbh(34 + 5as/h) = 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288) = 25165824 * 114
    assert korthikanti_layer_bytes(S, 1, H, A) == 25165824 * 114 == 2868903936


def test_korthikanti_tensor_parallel():
    # t = 8: sbh(10 + 24/8 + 5as/(8h)) = 25165824 * (10 + 3 + 10)
    assert korthikanti_layer_bytes(S, 1, H, A, t=8) == 25165824 * 23


def test_korthikanti_sequence_parallel_and_recompute():
    # t = 8 with sequence parallelism: sbh(34/8 + 80/8) = 25165824 * 14.25
    assert korthikanti_layer_bytes(S, 1, H, A, t=8, sequence_parallel=True) == 25165824 * 14.25
    # selective recomputation with sequence parallelism: sbh * 34 / t
    assert korthikanti_layer_bytes(S, 1, H, A, t=8, sequence_parallel=True, recompute="selective") == 25165824 * 34 / 8
    # full recomputation keeps the layer input: 2sbh
    assert korthikanti_layer_bytes(S, 1, H, A, recompute="full") == 2 * 25165824
    # micro-batch b scales every term
    assert korthikanti_layer_bytes(S, 4, H, A, t=8) == 4 * 25165824 * 23


def test_korthikanti_generalised_to_llama():
    # Llama-3-70B layer, t = 8, flash, no dropout: replicated 4 + 2 + 2, split (2 + 2/8) + 2/8 + 2 + 6 * 3.5
    s, h = 4096, 8192
    expected = s * h * (8 + (2.25 + 0.25 + 2 + 21) / 8)
    assert korthikanti_layer_bytes(s, 1, h, 64, t=8, ffn=28672, gated=True, kv_heads=8, dropout=False,
                                   flash=True) == expected


PUBLISHED = {  # parameters, from each checkpoint's model.safetensors.index.json total_size / 2 (bf16)
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648,
    # Qwen3: the parameter counts keras-hub's qwen3_presets.py lists (8B: the index's 16_381_470_720 bytes / 2)
    "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "qwen3-8b": 8_190_735_360, "qwen3-32b": 32_762_123_264,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    assert total_params(PRESETS[name]) == PUBLISHED[name]


def test_llama3_70b_stage_split_sums_to_the_model():
    cfg = PRESETS["llama3-70b"]
    for tp, pp in ((8, 1), (4, 4), (8, 4)):
        per_rank = sum(stage_params(cfg, tp, pp, s).total for s in range(pp))
        replicated_norms = 80 * 2 * 8192 + 8192  # RMSNorm gains are whole on every tp rank
        assert per_rank * tp - (tp - 1) * replicated_norms == total_params(cfg)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_stage_counts_match_the_built_model(tied, family):
    cfg = ModelConfig(family, vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8 if family == "qwen2" else 12,
                      qkv_bias=family == "qwen2", tie_word_embeddings=tied, max_position_embeddings=64)
    for stage, layer_range in enumerate(((0, 2), (2, 4))):
        built = CausalLM(cfg, layer_range=layer_range)
        assert sum(p.numel() for p in built.parameters()) == stage_params(cfg, 1, 2, stage).total
    assert sum(p.numel() for p in CausalLM(cfg).parameters()) == total_params(cfg)


def test_pipeline_in_flight_1f1b():
    assert [pipeline_in_flight(4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [pipeline_in_flight(4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="stage"):
        pipeline_in_flight(2, 2, 4)


def test_bad_sizes_name_the_argument():
    with pytest.raises(ValueError, match="zero_stage"):
        state_bytes_per_param(ZERO, 2, 4)
    with pytest.raises(ValueError, match="divisible by pp"):
        stage_params(PRESETS["llama3-70b"], 8, 3, 0)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        stage_params(PRESETS["llama3-70b"], 16, 1, 0)


def test_hf_config_json_reads_like_the_preset(tmp_path):
    cfg = PRESETS["qwen2.5-7b"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_hf()))
    for spec in (str(path), str(tmp_path)):
        assert total_params(load_model(spec)) == PUBLISHED["qwen2.5-7b"]
    with pytest.raises(FileNotFoundError, match="preset"):
        load_model(str(tmp_path / "nowhere"))
