"""Tensor- and data-parallel models on 2 gloo ranks against transformers and the dense (tp=1) megalign model.

The tiny HF checkpoints have a prime vocabulary (97), so at tp=2 it is padded to 98 and the second
rank holds a padding column. Gradients at tp=2 are compared after all-gathering each sharded
parameter's gradient along the split dimension the layer declares (`tp_sharded_parameters`).
Each `run_distributed` call runs several checks: starting ranks is the expensive part.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models.hf_fixtures import VOCAB, make_causal_lm, make_seq_cls, random_ids
from parallel.dist_utils import run_distributed
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, GenerationConfig

from conftest import TOL
from megalign.models import CausalLM, ModelConfig, from_pretrained, save_hf_checkpoint, tensor_parallel_config
from megalign.models.hf_adapter import hf_rule
from megalign.parallel import MixedPrecision, ParallelLayout, allreduce_gradients, clip_grad_norm_, zero1_optimizer
from megalign.parallel.layers import tp_sharded_parameters
from megalign.rollout import SamplingParams, generate

FP32 = TOL[torch.float32]
PAD = 0


def _all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `t` concatenated along `dim` (test-side, independent of the library's gathers)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over real tokens; logits `[B, T, VOCAB]`."""
    targets = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def _batch():
    ids, mask = random_ids(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding in one row
    return ids, mask


# ----- start-up checks (no processes needed)

def test_tensor_parallel_config_pads_vocab_and_names_bad_sizes():
    base = dict(model_type="llama", vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                head_dim=16)
    assert tensor_parallel_config(ModelConfig(**base, num_attention_heads=4, num_key_value_heads=2), 2).padded_vocab_size == 98
    kept = ModelConfig(**base, num_attention_heads=4, num_key_value_heads=2, vocab_pad_multiple=256)
    assert tensor_parallel_config(kept, 2).padded_vocab_size == 256  # 128 * tp stays Megatron's padding
    with pytest.raises(ValueError, match=r"^num_attention_heads \(3\) and num_key_value_heads \(1\) must be divisible "
                                         r"by the tensor-parallel size 2$"):
        tensor_parallel_config(ModelConfig(**base, num_attention_heads=3, num_key_value_heads=1), 2)
    with pytest.raises(ValueError, match=r"^num_key_value_heads \(1\) must be divisible by the tensor-parallel size 2$"):
        tensor_parallel_config(ModelConfig(**base, num_attention_heads=4, num_key_value_heads=1), 2)


# ----- logits (and a reward model's scores) vs transformers

LOGIT_FAMILIES = ["llama3_gqa", "llama_bias_mha", "qwen2_tied", "qwen2_untied", "qwen3_tied", "qwen3_untied"]


def _check_logits(paths, references, ids, reward_path, reward_ref):
    layout = ParallelLayout.build(tp=2)
    reward_model = from_pretrained(reward_path, kind="reward", layout=layout).eval()  # tp trunk, replicated head
    with torch.no_grad():
        assert_close(reward_model(ids), reward_ref, **FP32)
    for path, ref in zip(paths, references):
        model = from_pretrained(path, layout=layout).eval()
        with torch.no_grad():
            local = model(ids)
        assert local.shape == (*ids.shape, 49)  # 97 padded to 98, split over 2 ranks
        if layout.tp_rank == 1:  # global column 97 is padding: never any probability
            assert (local[..., -1] == float("-inf")).all() and torch.isfinite(local[..., :-1]).all()
        full = model.lm_head.gather_logits(local)
        assert_close(full, ref, **FP32, msg=lambda m: f"{path}: {m}")


def test_tp2_logits_and_rewards_match_transformers(tmp_path):
    ids = random_ids(2, 13)
    paths, refs = [], []
    for family in LOGIT_FAMILIES:
        hf = make_causal_lm(tmp_path / family, family)
        with torch.no_grad():
            refs.append(hf(ids).logits)
        paths.append(tmp_path / family)
    reward = make_seq_cls(tmp_path / "reward", "llama")
    with torch.no_grad():
        reward_ref = reward(ids).logits[:, 0]
    run_distributed(_check_logits, paths, refs, ids, tmp_path / "reward", reward_ref)


# ----- loss and every gradient at tp=2 vs tp=1

def _check_gradients(path, checkpointing):
    layout = ParallelLayout.build(tp=2)
    ids, mask = _batch()
    dense = from_pretrained(path).train()
    model = from_pretrained(path, layout=layout, activation_checkpointing=checkpointing).train()
    ref_loss = _next_token_loss(dense(ids, attention_mask=mask), ids, mask)
    ref_loss.backward()
    loss = _next_token_loss(model.lm_head.gather_logits(model(ids, attention_mask=mask)), ids, mask)
    loss.backward()
    assert_close(loss, ref_loss, **FP32)

    sharded = tp_sharded_parameters(model)
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad if p not in sharded else _all_gather(p.grad, sharded[p], layout.tp_group)
        ref = dense_params[name].grad
        if grad.shape[0] == 98:  # vocab rows: padding gets exactly zero gradient
            assert (grad[VOCAB:] == 0).all(), name
            grad = grad[:VOCAB]
        assert_close(grad, ref, **FP32, msg=lambda m: f"{name}: {m}")
    # the global grad norm counts every shard once and every replicated parameter once
    dense_norm = torch.nn.utils.get_total_norm([p.grad for p in dense.parameters()])
    assert_close(clip_grad_norm_(model, float("inf"), layout), dense_norm, **FP32)


@pytest.mark.parametrize("family,checkpointing", [("qwen2_tied", False), ("llama_bias_mha", True), ("qwen3_untied", True)])
def test_tp2_loss_and_gradients_match_tp1(tmp_path, family, checkpointing):
    make_causal_lm(tmp_path, family)
    run_distributed(_check_gradients, tmp_path, checkpointing)


# ----- save at tp=2, reload in transformers

def _check_save(path, out, ids, ref):
    layout = ParallelLayout.build(tp=2)
    model = from_pretrained(path, layout=layout)
    save_hf_checkpoint(model, out / "untouched")
    # one SGD step changes every tensor, so the reload must put each shard back in its place
    _next_token_loss(model.lm_head.gather_logits(model(ids, attention_mask=torch.ones_like(ids))),
                     ids, torch.ones_like(ids)).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.5 * p.grad)
        trained = model.lm_head.gather_logits(model.eval()(ids))
    save_hf_checkpoint(model, out / "trained")
    if layout.tp_rank != 0:
        return
    assert sorted(os.listdir(out / "trained")) == ["config.json", "model.safetensors"]  # no temporary left
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(out / "untouched").eval()(ids).logits, ref)
        assert_close(AutoModelForCausalLM.from_pretrained(out / "trained").eval()(ids).logits, trained, **FP32)


@pytest.mark.parametrize("family", ["qwen2_tied", "llama3_gqa", "qwen3_tied"])
def test_tp2_save_reloads_in_transformers(tmp_path, family):
    hf = make_causal_lm(tmp_path / "hf", family)
    ids = random_ids(2, 9)
    with torch.no_grad():
        ref = hf(ids).logits
    run_distributed(_check_save, tmp_path / "hf", tmp_path, ids, ref)


# ----- generation across tp ranks

def _left_padded(lengths):
    width = max(lengths)
    ids, mask = torch.full((len(lengths), width), PAD), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:], mask[row, width - n:] = random_ids(1, n, seed=row)[0], 1
    return ids, mask


def _check_generation(path, ids, mask, hf_greedy):
    layout = ParallelLayout.build(tp=2)
    model = from_pretrained(path, layout=layout, vocab_pad_multiple=64).eval()  # 128 rows: 31 padding on rank 1
    dense = from_pretrained(path).eval()
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, pad_token_id=PAD)
    assert torch.equal(generate(model, ids, mask, greedy).sequences, hf_greedy)
    assert torch.equal(generate(dense, ids, mask, greedy).sequences, hf_greedy)

    sampling = SamplingParams(max_new_tokens=10, temperature=1.5, top_k=20, pad_token_id=PAD)
    ref = generate(dense, ids, mask, sampling, torch.Generator().manual_seed(3))
    out = generate(model, ids, mask, sampling, torch.Generator().manual_seed(3))
    assert torch.equal(out.sequences, ref.sequences)  # the gathered distribution is the dense one
    assert_close(out.logprobs, ref.logprobs, **FP32)
    # ranks seeded differently still agree: tp rank 0's draw is broadcast
    out = generate(model, ids, mask, sampling, torch.Generator().manual_seed(100 + layout.tp_rank))
    both = _all_gather(out.sequences[None], 0, layout.tp_group)
    assert torch.equal(both[0], both[1]) and (out.sequences < VOCAB).all()


def test_tp2_generation_matches_tp1_and_transformers(tmp_path):
    hf = make_causal_lm(tmp_path, "llama3_gqa")
    ids, mask = _left_padded([3, 8, 5])
    config = GenerationConfig(do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=PAD)
    with torch.no_grad():
        hf_greedy = hf.generate(ids, attention_mask=mask, generation_config=config)
    run_distributed(_check_generation, tmp_path, ids, mask, hf_greedy)


# ----- bf16 compute over fp32 master weights at tp=2

def _check_bf16(path, ids, hf_logits, hf_grads):
    """hf_logits / hf_grads: transformers' fp32 and bf16-autocast results, {dtype: logits} / {dtype: {HF name: grad}}."""
    layout = ParallelLayout.build(tp=2)
    precision = MixedPrecision(torch.bfloat16)
    model = from_pretrained(path, layout=layout, activation_checkpointing=True).train()
    precision.check_model(model)
    with precision.autocast(layout.device):
        logits = model.lm_head.gather_logits(model(ids))
        loss = _next_token_loss(logits.float(), ids, torch.ones_like(ids))
    loss.backward()
    assert logits.dtype == torch.bfloat16

    def errors(ours, by_dtype):  # ours and transformers' bf16 error (norm) against transformers' fp32
        ref = by_dtype[torch.float32]
        return (ours.float() - ref).norm().item(), (by_dtype[torch.bfloat16] - ref).norm().item()

    ours_err, hf_err = errors(logits, hf_logits)
    assert ours_err <= 2 * hf_err, ("logits", ours_err, hf_err)
    # The whole gradient is held to 2x transformers' bf16 error; single tensors to 4x: the tp = 2
    # shards accumulate their bf16 matmuls in another order than the dense model, and on small
    # tensors (a k_proj gradient) that rounding noise moves with the CPU's matmul kernels (up to
    # 3.1x on an AVX2-only Zen 3, under 2x on AVX-512). A wrong gradient is off by far more.
    sharded = tp_sharded_parameters(model)
    total_ours = total_hf = 0.0
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32, name  # fp32 master gradients
        grad = p.grad if p not in sharded else _all_gather(p.grad, sharded[p], layout.tp_group)
        hf_name = hf_rule(name)[0]
        ours_err, hf_err = errors(grad[:VOCAB] if grad.shape[0] == 98 else grad,
                                  {dtype: grads[hf_name] for dtype, grads in hf_grads.items()})
        assert ours_err <= 4 * hf_err, (name, ours_err, hf_err)
        total_ours, total_hf = total_ours + ours_err**2, total_hf + hf_err**2
    assert total_ours**0.5 <= 2 * total_hf**0.5, ("all gradients", total_ours**0.5, total_hf**0.5)


@pytest.mark.parametrize("family", ["qwen2_untied", "qwen3_untied"])
def test_bf16_autocast_tp2_no_worse_than_transformers(tmp_path, family):
    hf = make_causal_lm(tmp_path, family).train()
    ids = random_ids(2, 12)
    hf_logits, hf_grads = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        hf.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = hf(ids).logits
            loss = _next_token_loss(logits.float(), ids, torch.ones_like(ids))
        loss.backward()
        hf_logits[dtype] = logits.detach().float()
        hf_grads[dtype] = {name: p.grad.clone() for name, p in hf.named_parameters()}
    run_distributed(_check_bf16, tmp_path, ids, hf_logits, hf_grads)


def test_mixed_precision_rejects_fp16_and_bf16_masters():
    with pytest.raises(ValueError, match="fp16 would need loss scaling"):
        MixedPrecision(torch.float16)
    model = CausalLM(ModelConfig(model_type="qwen2", vocab_size=11, hidden_size=8, intermediate_size=8,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4))
    model.lm_head.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"1 are not: lm_head.proj.weight \(torch.bfloat16\)"):
        MixedPrecision().check_model(model)


# ----- data parallel: 3 ZeRO-1 AdamW steps at dp=2 equal dense AdamW on the global batch

def _check_dp_steps(path, batches):
    layout = ParallelLayout.build(tp=1)  # dp=2
    model = from_pretrained(path, layout=layout).train()
    dense = from_pretrained(path).train()
    opt = zero1_optimizer(model.parameters(), layout.dp_group, lr=1e-2)
    dense_opt = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    for ids in batches:
        mask = torch.ones_like(ids)
        local = ids.chunk(layout.dp)[layout.dp_rank]  # equal token counts: the mean of local means is the global mean
        _next_token_loss(model(local), local, torch.ones_like(local)).backward()
        allreduce_gradients(model.parameters(), layout.dp_group)
        opt.step()
        opt.zero_grad()
        _next_token_loss(dense(ids), ids, mask).backward()
        dense_opt.step()
        dense_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), dense.parameters()):
        assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(model.model.norm.weight, from_pretrained(path).model.norm.weight)  # it did train


def test_dp2_zero1_steps_match_dense(tmp_path):
    make_causal_lm(tmp_path, "llama3_gqa")
    run_distributed(_check_dp_steps, tmp_path, [random_ids(4, 8, seed=s) for s in range(3)])
