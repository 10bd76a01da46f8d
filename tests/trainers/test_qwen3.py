"""Qwen3 through the trainers: a GRPO step on an actor started from a Qwen3 checkpoint written by transformers
(tensor-parallel actor, the q/k norm gradients summed over the tp group, a reference), and SFT of a Qwen3 built
from scratch; both exports load back in transformers as Qwen3."""
import json
import os

import torch
from parallel.dist_utils import run_distributed
from safetensors.torch import load_file
from trainers.grpo_helpers import tiny_config
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from megalign.config import load_config
from megalign.data import CharTokenizer
from megalign.models import from_pretrained
from megalign.trainers.grpo import train_grpo
from megalign.trainers.sft import SFTConfig, train_sft


def _qwen3_policy(path) -> str:
    """A 2-layer random tied Qwen3 over the character vocabulary, head_dim 16 (hidden / heads is 8)."""
    tok = CharTokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                         eos_token_id=tok.eos_id)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # HF starts the gains at 1; random ones make the q/k norms matter
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return str(path)


def _train(policy, run_dir):
    train_grpo(tiny_config(policy, run_dir, "steps=1", "actor.tp=2", "algo.kl_coef=0.1"))


def test_grpo_step_from_a_qwen3_checkpoint(tmp_path):
    policy = _qwen3_policy(tmp_path / "qwen3")
    run_dir = tmp_path / "run"
    run_distributed(_train, policy, str(run_dir))
    with open(run_dir / "metrics.jsonl") as f:
        (row,) = [r for r in map(json.loads, f) if "reward/mean" in r]
    assert row["step"] == 1 and row["nan_skips"] == 0 and row["actor/grad_norm"] > 0

    export = run_dir / "hf"
    with open(export / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
    before, after = load_file(os.path.join(policy, "model.safetensors")), load_file(export / "model.safetensors")
    assert sorted(before) == sorted(after)  # the tied matrix once, both q/k norms of every layer
    assert not torch.equal(after["model.layers.0.self_attn.q_norm.weight"], before["model.layers.0.self_attn.q_norm.weight"])
    reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
    assert isinstance(reloaded, Qwen3ForCausalLM)
    ids = torch.randint(3, CharTokenizer().vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(export).eval()(ids), reloaded(ids).logits, atol=1e-5, rtol=1e-4)


def _sft_from_scratch(run_dir):
    train_sft(load_config(SFTConfig, None, [
        f"run_dir={run_dir}", "steps=2", "batch_size=4", "model.model_type=qwen3", "model.tp=2", "model.hidden_size=32",
        "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
        "data.arith.max_operand=4", "optim.lr=1e-2", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "save_every=0"]))


def test_sft_of_a_qwen3_from_scratch(tmp_path):
    run_distributed(_sft_from_scratch, str(tmp_path))
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    q_norm = exported["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (16,) and not torch.equal(q_norm, torch.ones(16))  # started at 1, trained as one gain
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(reloaded, Qwen3ForCausalLM)
    ids = torch.randint(3, CharTokenizer().vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(tmp_path / "hf").eval()(ids), reloaded(ids).logits, atol=1e-5,
                                   rtol=1e-4)
