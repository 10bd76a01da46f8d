"""HF checkpoint interop: sharded loads, strict name checks, vocab padding, save -> transformers reload, reward heads."""
import json
import os

import pytest
import torch
from models.hf_fixtures import VOCAB, make_causal_lm, make_seq_cls, random_ids
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

from conftest import TOL
from megalign.models import (CausalLM, LayerFactory, ModelConfig, from_pretrained, hf_architecture, load_hf_weights,
                             save_hf_checkpoint)
from megalign.models.hf_adapter import hf_rule

FP32 = TOL[torch.float32]


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_causal_lm(tmp_path / "one", "qwen2_untied")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    ours = from_pretrained(tmp_path / "sharded").eval()
    ids = random_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, **FP32)


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
    make_causal_lm(tmp_path, "llama3_gqa")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.rotary.inv_freq"] = torch.zeros(3)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        from_pretrained(tmp_path)
    msg = str(err.value)
    assert "missing tensors ['model.layers.1.mlp.up_proj.weight', 'model.norm.weight']" in msg
    assert "unexpected tensors ['model.layers.0.self_attn.rotary.inv_freq']" in msg


def test_wrong_shape_names_tensor(tmp_path):
    make_causal_lm(tmp_path, "llama3_gqa")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128  # file holds 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \[96, 64\], expected \[128, 64\]"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["qwen2_tied", "llama3_gqa", "mistral_window", "qwen3_untied"])
def test_padded_vocab_round_trip_through_transformers(tmp_path, family):
    hf = make_causal_lm(tmp_path / "in", family)
    ours = from_pretrained(tmp_path / "in", vocab_pad_multiple=64).eval()
    assert ours.model.embed.weight.shape[0] == 128
    ids = random_ids(2, 13)
    with torch.no_grad():
        logits = ours(ids)
        assert torch.isneginf(logits[..., VOCAB:]).all()  # padding never receives probability
        torch.testing.assert_close(logits[..., :VOCAB], hf(ids).logits, **FP32)
    save_hf_checkpoint(ours, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]  # no temporary left
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, atol=0, rtol=0)
        ours.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"tensors \['model.layers.1.mlp.up_proj.weight'\] hold NaN or inf"):
        save_hf_checkpoint(ours, tmp_path / "nan")
    assert not os.path.exists(tmp_path / "nan")


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_reward_head_matches_sequence_classification(tmp_path, family):
    hf = make_seq_cls(tmp_path / "rm", family)
    ours = from_pretrained(tmp_path / "rm", kind="reward").eval()
    ids = random_ids(3, 8)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # right padding, as HF pools at the rightmost non-pad token
    mask[2, 1:] = 0
    ids = ids.masked_fill(mask == 0, 0)  # 0 is the pad id
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits[:, 0]
        torch.testing.assert_close(ours(ids, attention_mask=mask), ref, **FP32)
        # the critic starts from the same checkpoint: per-token values are `score` on HF's hidden states
        critic = from_pretrained(tmp_path / "rm", kind="value").eval()
        values = hf.score(hf.model(ids, attention_mask=mask).last_hidden_state)[..., 0]
        torch.testing.assert_close(critic(ids, attention_mask=mask)[mask.bool()], values[mask.bool()], **FP32)
    # the critic's export (what verl's critic loads): the family's token classifier, one label, no bias
    save_hf_checkpoint(critic, tmp_path / "critic", architecture=hf_architecture(family, "TokenClassification"))
    token_cls = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic").eval()
    assert type(token_cls).__name__ == hf_architecture(family, "TokenClassification") and token_cls.score.bias is None
    with torch.no_grad():
        torch.testing.assert_close(token_cls(ids, attention_mask=mask).logits[..., 0][mask.bool()], values[mask.bool()],
                                   **FP32)
    save_hf_checkpoint(ours, tmp_path / "out")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits[:, 0], ref, atol=0, rtol=0)


def test_reward_head_pools_packed_documents(tmp_path):
    hf = make_seq_cls(tmp_path, "qwen2")
    ours = from_pretrained(tmp_path, kind="reward").eval()
    seqs = [random_ids(1, n, seed=n)[0] for n in (4, 7, 2)]
    cu_seqlens = torch.tensor([0, 4, 11, 13])
    with torch.no_grad():
        ref = torch.stack([hf(s[None]).logits[0, 0] for s in seqs])
        torch.testing.assert_close(ours(torch.cat(seqs)[None], cu_seqlens=cu_seqlens), ref, **FP32)


class _ShardShapes(LayerFactory):
    """tp-rank factory with plain modules of the local sizes: enough to check what a rank reads from disk."""

    def __init__(self, rank: int, size: int):
        self.tp_rank, self.tp_size = rank, size

    def embedding(self, num_embeddings, dim):
        return super().embedding(num_embeddings // self.tp_size, dim)

    def column_linear(self, in_features, out_features, bias):
        return super().column_linear(in_features, out_features // self.tp_size, bias)

    def row_linear(self, in_features, out_features, bias):
        return torch.nn.Linear(in_features // self.tp_size, out_features, bias=bias)


def test_tp_rank_reads_its_slices(tmp_path):
    make_causal_lm(tmp_path, "qwen2_untied")
    full = load_file(tmp_path / "model.safetensors")
    config = ModelConfig.from_hf(tmp_path, vocab_pad_multiple=4)  # 97 -> 100 rows, 50 per rank
    for rank in range(2):
        shard = CausalLM(config, _ShardShapes(rank, 2))
        assert shard.model.layers[0].attn.n_heads_local == 2 and shard.model.layers[0].attn.n_kv_heads_local == 1
        load_hf_weights(shard, tmp_path)
        for name, param in shard.named_parameters():
            hf_name, shard_dim = hf_rule(name)
            want = full[hf_name]
            if shard_dim is not None:
                n = param.shape[shard_dim]
                want = torch.nn.functional.pad(want, (0, 0, 0, 3)) if hf_name.endswith(("embed_tokens.weight", "lm_head.weight")) else want
                want = want.narrow(shard_dim, rank * n, n)
            torch.testing.assert_close(param.detach(), want, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.get_slice("lm_head.weight").get_shape() == [VOCAB, 64]


def test_tp_divisibility_is_checked(tmp_path):
    make_causal_lm(tmp_path, "llama3_gqa")  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match=r"^num_key_value_heads \(2\) and padded_vocab_size \(97\) must be divisible "
                                         r"by the tensor-parallel size 4; pad the vocabulary"):
        CausalLM(ModelConfig.from_hf(tmp_path), _ShardShapes(0, 4))
