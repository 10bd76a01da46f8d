"""Pipeline parallelism at pp=2 (2 gloo ranks) vs transformers (logits) and the unpipelined model (loss, grads,
grad norm, optimizer steps), including tied word embeddings split across stages and tp=2 x pp=2 (4 ranks)."""
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from models.hf_fixtures import VOCAB, make_causal_lm, make_seq_cls, random_ids
from parallel.dist_utils import run_distributed

from conftest import TOL
from megalign.models import from_pretrained, save_hf_checkpoint, stage_from_pretrained
from megalign.models.hf_adapter import hf_rule
from megalign.parallel import (ParallelLayout, Pipeline, clip_grad_norm_, pp_tied_parameters,
                               stage_layer_range)

FP32 = TOL[torch.float32]
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)  # sums over tokens in another order than the unpipelined backward
PLAN = ParallelLayout(tp=1, pp=2, dp=1, world_size=2, rank=1)  # rank arithmetic only, no processes


def _padded_batch():
    """ids `[4, 12]` and a left-padding mask giving each row (so each micro-batch) a different token count."""
    ids = random_ids(4, 12)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 5, 2, 9]):
        mask[row, :pad] = 0
    return ids, mask


def _token_logprobs(logits, batch):
    """`[b, T-1]` log p(next token) from logits `[b, T, V]`."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["labels"][:, 1:, None])[..., 0]


def _pg_loss_sum(logits, batch):
    """Policy-gradient-style summed loss: -sum(advantage * log p * mask) over the valid next tokens."""
    return -(batch["advantages"][:, 1:] * _token_logprobs(logits, batch) * batch["mask"][:, 1:]).sum()


def _check_score(lm_path, critic_path, ids, mask, ref_logits, ref_values):
    layout = ParallelLayout.build(pp=2)
    pipe = Pipeline(stage_from_pretrained(lm_path, layout).eval(), layout, n_microbatches=2)
    logits = pipe.score(ids, attention_mask=mask)
    logprobs = pipe.score(ids, _token_logprobs, attention_mask=mask, batch={"labels": ids})
    critic = Pipeline(stage_from_pretrained(critic_path, layout, kind="value").eval(), layout, n_microbatches=4)
    values = critic.score(ids, attention_mask=mask)
    if not layout.is_last_stage:
        assert logits is None and logprobs is None and values is None
        return
    real = mask.bool()  # padding queries are masked out downstream and differ from HF's
    torch.testing.assert_close(logits[real], ref_logits[real], **FP32)
    ref_logprobs = _token_logprobs(ref_logits, {"labels": ids})
    torch.testing.assert_close(logprobs[real[:, :-1]], ref_logprobs[real[:, :-1]], **FP32)
    torch.testing.assert_close(values[real], ref_values[real], **FP32)


def test_score_matches_transformers(tmp_path):
    """Logits and log-probs vs LlamaForCausalLM; a critic's per-token values vs HF's sequence classifier
    (its `score` projection at every token, before the last-token pooling)."""
    hf = make_causal_lm(tmp_path / "lm", "llama3_gqa", num_hidden_layers=4)
    hf_critic = make_seq_cls(tmp_path / "critic", "llama")
    ids, mask = _padded_batch()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref_logits = hf(ids, attention_mask=mask, position_ids=position_ids).logits
        hidden = hf_critic.model(ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
        ref_values = hf_critic.score(hidden)[..., 0]
    run_distributed(_check_score, tmp_path / "lm", tmp_path / "critic", ids, mask, ref_logits, ref_values)


def _ref_name(stage, name):
    """HF name (global layer index) of a stage parameter; a tied LM-head copy is the unpipelined embedding."""
    if name == "lm_head.proj.weight" and stage.config.tie_word_embeddings:
        return "model.embed_tokens.weight"
    return hf_rule(name, stage.model.layer_range[0])[0]


def _pg_batch(ids, mask, seed=3):
    """Loss inputs of `_pg_loss_sum` with random advantages `[B, T]` drawn from `seed`."""
    advantages = torch.randn(ids.shape, generator=torch.Generator().manual_seed(seed))
    return {"labels": ids, "mask": mask.float(), "advantages": advantages}


def _tied_score_and_save(path, out, ids, mask, ref_logits):
    layout = ParallelLayout.build(pp=2)
    stage = stage_from_pretrained(path, layout).eval()
    logits = Pipeline(stage, layout, n_microbatches=2).score(ids, attention_mask=mask)
    if layout.is_last_stage:
        real = mask.bool()  # padding queries are masked out downstream and differ from HF's
        torch.testing.assert_close(logits[real], ref_logits[real], **FP32)
    save_hf_checkpoint(stage, out, layout=layout)


def test_tied_stages_match_transformers_and_save_the_matrix_once(tmp_path):
    """Tied Qwen2 at pp=2: logits vs Qwen2ForCausalLM, the last stage's head read from the embedding tensor
    (a stray lm_head.weight in the file is ignored); the saved checkpoint holds the matrix once and
    transformers reloads it with identical logits."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2ForCausalLM
    hf = make_causal_lm(tmp_path / "lm", "qwen2_tied", num_hidden_layers=4)
    weights = tmp_path / "lm" / "model.safetensors"
    tensors = load_file(weights)
    assert "lm_head.weight" not in tensors
    save_file({**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])}, weights)
    ids, mask = _padded_batch()
    with torch.no_grad():
        ref_logits = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    run_distributed(_tied_score_and_save, tmp_path / "lm", str(tmp_path / "out"), ids, mask, ref_logits)
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert weight_map["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert "lm_head.weight" not in weight_map
    with torch.no_grad():
        torch.testing.assert_close(Qwen2ForCausalLM.from_pretrained(tmp_path / "out")(ids).logits, hf(ids).logits,
                                   rtol=0, atol=0)


def _check_train_step(path, n_microbatches, split, batch, ref_loss, ref_grads, ref_norm):
    layout = ParallelLayout.build(pp=2)
    model = stage_from_pretrained(path, layout, split=split).train()
    normalizer = batch["mask"][:, 1:].sum()
    loss = Pipeline(model, layout, n_microbatches).train_step(
        batch["labels"], _pg_loss_sum, normalizer, attention_mask=batch["mask"], batch=batch)
    torch.testing.assert_close(loss, ref_loss, **FP32)  # on every stage: broadcast from the last
    norm = clip_grad_norm_(model, math.inf, layout)  # finalises the step: sums a tied matrix's two copies
    torch.testing.assert_close(norm, ref_norm, **FP32)
    names = []
    for name, p in model.named_parameters():
        hf_name = _ref_name(model, name)
        names.append(hf_name)
        torch.testing.assert_close(p.grad, ref_grads[hf_name], **GRAD_TOL, msg=lambda m: f"{hf_name}: {m}")
    stage_names = [None] * layout.pp
    dist.all_gather_object(stage_names, names, group=layout.pp_group)
    # the stages hold every parameter exactly once, except a tied matrix: once per end of the pipeline
    copies = ["model.embed_tokens.weight"] if model.config.tie_word_embeddings else []
    assert sorted(sum(stage_names, [])) == sorted(list(ref_grads) + copies)


@pytest.mark.parametrize("family,n_microbatches,split", [("qwen2_untied", 2, None), ("qwen2_untied", 4, (3, 1)),
                                                         ("qwen2_tied", 2, None), ("qwen3_tied", 2, None)])
def test_train_step_matches_unpipelined(tmp_path, family, n_microbatches, split):
    """Loss, grad norm and every gradient vs the unpipelined model; tied: both copies get the shared matrix's gradient."""
    make_causal_lm(tmp_path, family, num_hidden_layers=4)
    ids, mask = _padded_batch()
    batch = _pg_batch(ids, mask)
    dense = from_pretrained(tmp_path).train()
    ref_loss = _pg_loss_sum(dense(ids, attention_mask=mask), batch) / mask[:, 1:].sum()
    ref_loss.backward()
    ref_grads = {hf_rule(name)[0]: p.grad for name, p in dense.named_parameters()}  # a tied matrix once
    ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values()))
    run_distributed(_check_train_step, tmp_path, n_microbatches, split, batch, ref_loss.detach(), ref_grads, ref_norm)


MAX_NORM = 0.05  # below every step's gradient norm here, so clipping acts (checked on the reference)


def _sgd(params):
    """Momentum and weight decay: every step's update depends on all earlier (clipped) gradients."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1)


def _check_tied_steps(path, ids, mask, batches, ref_norms, ref_params):
    layout = ParallelLayout.build(pp=2)
    model = stage_from_pretrained(path, layout).train()
    tied = pp_tied_parameters(model)
    assert list(tied.values()) == [layout.is_last_stage]  # the embedding on stage 0, its copy on stage 1
    pipe, optimizer = Pipeline(model, layout, n_microbatches=2), _sgd(model.parameters())
    for batch, ref_norm in zip(batches, ref_norms):
        pipe.train_step(ids, _pg_loss_sum, batch["mask"][:, 1:].sum(), attention_mask=mask, batch=batch)
        torch.testing.assert_close(clip_grad_norm_(model, MAX_NORM, layout), ref_norm, **FP32)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        hf_name = _ref_name(model, name)
        torch.testing.assert_close(p.detach(), ref_params[hf_name], **GRAD_TOL, msg=lambda m: f"{hf_name}: {m}")
    (weight,) = tied
    first = weight.detach().clone()
    dist.broadcast(first, src=layout.stage_rank(0), group=layout.embedding_group)
    torch.testing.assert_close(weight.detach(), first, rtol=0, atol=0)  # the copies stay bitwise equal


def test_tied_optimizer_steps_match_unpipelined(tmp_path):
    """Three clipped SGD steps of a tied Qwen2 at pp=2 equal pp=1 (torch's clip_grad_norm_ on the unsplit model)."""
    make_causal_lm(tmp_path, "qwen2_tied", num_hidden_layers=4)
    ids, mask = _padded_batch()
    batches = [_pg_batch(ids, mask, seed) for seed in range(3)]
    dense = from_pretrained(tmp_path).train()
    optimizer, ref_norms = _sgd(dense.parameters()), []
    for batch in batches:
        (_pg_loss_sum(dense(ids, attention_mask=mask), batch) / mask[:, 1:].sum()).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(dense.parameters(), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert min(ref_norms) > MAX_NORM
    ref_params = {hf_rule(name)[0]: p.detach() for name, p in dense.named_parameters()}
    run_distributed(_check_tied_steps, tmp_path, ids, mask, batches, ref_norms, ref_params)


def test_layer_split_checks():
    with pytest.raises(ValueError, match=r"num_hidden_layers=5 is not divisible by pp=2.*\[3, 2\]"):
        stage_layer_range(5, PLAN)
    with pytest.raises(ValueError, match=r"stage_layers=\[4, 0\]: each stage needs at least one layer"):
        stage_layer_range(4, PLAN, split=(4, 0))
    with pytest.raises(ValueError, match=r"stage_layers=\[2, 2\] sums to 4, not the model's 5 decoder layers"):
        stage_layer_range(5, PLAN, split=(2, 2))
    assert stage_layer_range(5, PLAN, split=(3, 2)) == (3, 5)
    assert stage_layer_range(4, PLAN) == (2, 4)


def test_stage_of_checkpoint_and_its_input_checks(tmp_path):
    make_causal_lm(tmp_path, "llama3_gqa", num_hidden_layers=4)
    last = from_pretrained(tmp_path, layer_range=stage_layer_range(4, PLAN))  # layers 2, 3, final norm, LM head
    dense = from_pretrained(tmp_path)
    assert last.model.embed is None and last.lm_head is not None
    for name, p in last.named_parameters():
        torch.testing.assert_close(p, dense.get_parameter(name.replace("layers.0.", "layers.2.")
                                                          .replace("layers.1.", "layers.3.")), rtol=0, atol=0)
    with pytest.raises(ValueError, match="n_microbatches=1 must be >= pp=2"):
        Pipeline(last, PLAN, n_microbatches=1)
    with pytest.raises(ValueError, match="batch size 4 is not divisible by n_microbatches=3"):
        Pipeline(last, PLAN, n_microbatches=3).score(random_ids(4, 5))
    with pytest.raises(ValueError, match=r"batch\['labels'\] has 3 rows, input_ids has 4"):
        Pipeline(last, PLAN, n_microbatches=2).score(random_ids(4, 5), batch={"labels": random_ids(3, 5)})
    with pytest.raises(RuntimeError, match="has no DeviceMesh"):  # stages are built over the layout's groups
        stage_from_pretrained(tmp_path, PLAN)


def _save_stages(path, out, ref_logits, ids):
    layout = ParallelLayout.build(pp=2)
    stage = stage_from_pretrained(path, layout)
    save_hf_checkpoint(stage, out, layout=layout)  # every stage returns once the checkpoint is in place
    assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert not [f for f in os.listdir(os.path.dirname(out)) if ".tmp-" in f or ".old-" in f]
    if layout.is_first_stage:
        from transformers import LlamaForCausalLM
        with torch.no_grad():
            logits = LlamaForCausalLM.from_pretrained(out).eval()(ids).logits
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    dist.barrier(group=layout.pp_group)
    save_hf_checkpoint(stage, out, layout=layout)  # over an existing checkpoint: replaced whole
    assert len(os.listdir(out)) == 4
    with torch.no_grad():
        name = next(n for n, _ in stage.named_parameters() if n.endswith("mlp_norm.weight"))
        stage.get_parameter(name).fill_(float("nan"))
    with pytest.raises(ValueError, match=r"hold NaN or inf"):  # refused on both stages, NaN on each
        save_hf_checkpoint(stage, os.path.join(os.path.dirname(out), "nan"), layout=layout)
    assert not os.path.exists(os.path.join(os.path.dirname(out), "nan"))


def test_save_hf_checkpoint_of_pipeline_stages(tmp_path):
    """pp=2: each stage writes its shard; transformers loads the sharded checkpoint with identical logits."""
    hf = make_causal_lm(tmp_path / "lm", "llama3_gqa", num_hidden_layers=4)
    ids = random_ids(2, 9)
    with torch.no_grad():
        ref_logits = hf(ids).logits
    run_distributed(_save_stages, tmp_path / "lm", str(tmp_path / "out"), ref_logits, ids)
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert weight_map["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert weight_map["model.layers.3.mlp.down_proj.weight"] == "model-00002-of-00002.safetensors"
    assert weight_map["lm_head.weight"] == "model-00002-of-00002.safetensors"


def test_save_hf_checkpoint_refuses_stage_without_layout(tmp_path):
    make_causal_lm(tmp_path, "llama3_gqa", num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"layers \(2, 4\) out of 4 without a layout"):
        save_hf_checkpoint(from_pretrained(tmp_path, layer_range=stage_layer_range(4, PLAN)), tmp_path / "out")


def _check_tp_pipeline(path, ids, mask, ref_logits, batch, ref_loss, ref_embed_grad, ref_norm):
    layout = ParallelLayout.build(tp=2, pp=2)
    stage = stage_from_pretrained(path, layout)
    pipe = Pipeline(stage.eval(), layout, n_microbatches=2)
    logits = pipe.score(ids, attention_mask=mask)  # vocab-sharded [B, T, V_pad / tp] on the last stage
    if layout.is_last_stage:
        real = mask.bool()
        torch.testing.assert_close(stage.lm_head.gather_logits(logits)[real], ref_logits[real], **FP32)
    loss = pipe.train_step(ids, lambda out, b: _pg_loss_sum(stage.lm_head.gather_logits(out), b),
                           batch["mask"][:, 1:].sum(), attention_mask=mask, batch=batch)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    torch.testing.assert_close(clip_grad_norm_(stage, math.inf, layout), ref_norm, **FP32)
    (weight,) = pp_tied_parameters(stage)  # this tp rank's vocab rows of the embedding or of its copy
    assert weight.shape[0] == (VOCAB + 1) // layout.tp  # the stage really is tp-sharded, vocabulary padded to 98
    start, end = stage.model.factory.vocab_range(stage.config.padded_vocab_size)
    expected = torch.zeros_like(weight)  # padding rows get no gradient
    expected[: min(end, VOCAB) - start] = ref_embed_grad[start:end]
    torch.testing.assert_close(weight.grad, expected, **GRAD_TOL)


@pytest.mark.parametrize("family", ["qwen2_tied", "qwen3_tied"])
def test_tensor_parallel_pipeline_matches_transformers(tmp_path, family):
    """tp=2 x pp=2 on 4 ranks, tied Qwen2 / Qwen3 with a vocabulary (97) padded for tp: logits vs transformers; loss,
    grad norm (Qwen3's q/k norm gradients summed over tp) and the tied matrix's gradient shards (per tp rank, on
    both stages) vs the unpipelined model."""
    hf = make_causal_lm(tmp_path, family, num_hidden_layers=4)
    ids, mask = _padded_batch()
    batch = _pg_batch(ids, mask)
    with torch.no_grad():
        ref_logits = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    dense = from_pretrained(tmp_path).train()
    ref_loss = _pg_loss_sum(dense(ids, attention_mask=mask), batch) / mask[:, 1:].sum()
    ref_loss.backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in dense.parameters()])
    run_distributed(_check_tp_pipeline, tmp_path, ids, mask, ref_logits, batch, ref_loss.detach(),
                    dense.model.embed.weight.grad, ref_norm, world_size=4)


def _save_tp_stages(path, out):
    layout = ParallelLayout.build(tp=2, pp=2)
    stage = from_pretrained(path, layer_range=stage_layer_range(4, layout), layout=layout)
    save_hf_checkpoint(stage, out, layout=layout)  # tp rank 0 of each stage gathers and writes


def test_save_hf_checkpoint_of_tensor_parallel_pipeline_stages(tmp_path):
    """tp=2 x pp=2 on 4 ranks: the tp shards are gathered per stage, transformers reads identical logits."""
    from transformers import LlamaForCausalLM
    hf = make_causal_lm(tmp_path / "lm", "llama3_gqa", num_hidden_layers=4)
    run_distributed(_save_tp_stages, tmp_path / "lm", str(tmp_path / "out"), world_size=4)
    ids = random_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(LlamaForCausalLM.from_pretrained(tmp_path / "out")(ids).logits, hf(ids).logits,
                                   rtol=0, atol=0)
