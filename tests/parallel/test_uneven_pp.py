"""Pipeline stages of uneven size (Megatron's first / last stage layer counts, or an explicit list).

References: transformers (logits of the same HF checkpoint), the unpipelined model (loss and every gradient) and an
unpipelined SFT run (metrics and the trained weights of its HF export); the split arithmetic against Megatron's rule
(the stages between the first and the last split the rest evenly), worked by hand.
A 5-layer model at pp = 2 as [2, 3] and [3, 2], and at pp = 3 as first = last = 1 ([1, 3, 1], 3 processes); GRPO
with its actor and reference split differently ([2, 1] and [1, 2]) against the unpipelined GRPO run.
"""
import json
import os

import pytest
import torch
from models.hf_fixtures import make_causal_lm
from parallel.dist_utils import run_distributed
from parallel.test_pipeline import FP32, GRAD_TOL, _padded_batch, _pg_batch, _pg_loss_sum, _ref_name
from trainers.test_sft_pipeline import hf_logits, tiny

from megalign.checkpoint import CheckpointManager, ModelState
from megalign.config import ConfigError, load_config
from megalign.models import from_pretrained, save_hf_checkpoint, stage_from_pretrained
from megalign.models.hf_adapter import hf_rule
from megalign.parallel import ParallelLayout, Pipeline, StageSplit, clip_grad_norm_, stage_layer_range
from megalign.rollout import SamplingParams, generate, pipeline_generate
from megalign.trainers.model_checks import ModelError, check_stages
from megalign.trainers.sft import SFTConfig, train_sft

LAYERS = 5


# ----- the split arithmetic and its errors (no processes)

@pytest.mark.parametrize("split, num_layers, pp, sizes", [
    (StageSplit(), 8, 4, [2, 2, 2, 2]),
    (StageSplit(first_stage_layers=2, last_stage_layers=2), 28, 8, [2, 4, 4, 4, 4, 4, 4, 2]),  # Qwen2.5-7B at pp=8
    (StageSplit(first_stage_layers=26), 80, 3, [26, 27, 27]),  # an 80-layer model at pp=3: first 26, 54 / 2 each
    (StageSplit(first_stage_layers=11, last_stage_layers=11), 94, 8, [11, 12, 12, 12, 12, 12, 12, 11]),  # 235B-A22B
    (StageSplit(last_stage_layers=2), 5, 2, [3, 2]),
    (StageSplit(first_stage_layers=2, last_stage_layers=3), 5, 2, [2, 3]),  # no middle stage: Megatron allows it
    (StageSplit(stage_layers=(2, 3)), 5, 2, [2, 3]),
])
def test_megatron_split_by_hand(split, num_layers, pp, sizes):
    assert split.sizes(num_layers, pp) == sizes
    layouts = [ParallelLayout(tp=1, pp=pp, dp=1, world_size=pp, rank=r).with_stages(split) for r in range(pp)]
    ranges = [stage_layer_range(num_layers, layout) for layout in layouts]
    assert ranges == [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(pp)]


@pytest.mark.parametrize("overrides, message", [
    (["model.pp=2", "model.stage_layers=[2,2,1]"], r"'model'.*stage_layers=\[2, 2, 1\] has 3 entries but pp=2"),
    (["model.pp=2", "model.stage_layers=[0,5]"], r"'model'.*stage_layers=\[0, 5\]: each stage needs at least one"),
    (["model.pp=2", "model.stage_layers=[2,3]", "model.first_stage_layers=2"], r"stage_layers and first_stage_layers"),
    (["model.first_stage_layers=2"], r"first_stage_layers / last_stage_layers need pp >= 2"),
    (["model.pp=3", "model.last_stage_layers=0"], r"last_stage_layers must be an int >= 1, got 0"),
])
def test_bad_options_fail_when_the_config_loads(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(SFTConfig, None, [f"run_dir={tmp_path}", *overrides])


def test_layer_count_errors_name_the_options():
    with pytest.raises(ModelError, match=r"actor.pp=8 does not divide the 28 decoder layers of actor.path 'q': set "
                                         r"actor.first_stage_layers / actor.last_stage_layers .* or "
                                         r"actor.stage_layers, "
                                         r"e.g. \[3, 3, 4, 4, 4, 4, 3, 3\]"):
        check_stages(28, 8, "actor", "actor.path 'q'")
    with pytest.raises(ModelError, match=r"actor.stage_layers=\[2, 2\] sums to 4, not the model's 5 decoder layers"):
        check_stages(5, 2, "actor", "actor.path 'q'", StageSplit(stage_layers=(2, 2)))
    with pytest.raises(ModelError, match=r"critic.first_stage_layers=2 leaves 3 of the 5 decoder layers for the 2 "
                                         r"other stage\(s\) of pp=3, which must split them evenly"):
        check_stages(5, 3, "critic", "critic.path 'v'", StageSplit(first_stage_layers=2))
    with pytest.raises(ValueError, match=r"first_stage_layers=4 and last_stage_layers=2 leave -1 of the 5"):
        StageSplit(first_stage_layers=4, last_stage_layers=2).sizes(5, 3)
    with pytest.raises(ValueError, match=r"num_hidden_layers=5 is not divisible by pp=2; set first_stage_layers"):
        stage_layer_range(5, ParallelLayout(tp=1, pp=2, dp=1, world_size=2))
    check_stages(5, 2, "actor", "x", StageSplit(last_stage_layers=2))  # fits: no error


# ----- stages vs transformers and the unpipelined model (2 or 3 gloo processes)

SAMPLED = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, pad_token_id=0)


def _check_stage(path, pp, split, ids, mask, batch, ref_logits, ref_loss, ref_grads, ref_norm, ref_sampled, out):
    layout = ParallelLayout.build(pp=pp).with_stages(split)
    sizes = split.sizes(LAYERS, pp)
    stage = stage_from_pretrained(path, layout).train()  # the layout's split: no `split` argument
    start = sum(sizes[: layout.pp_rank])
    assert stage.model.layer_range == (start, start + sizes[layout.pp_rank])
    with torch.no_grad():
        logits = Pipeline(stage, layout, n_microbatches=4).score(ids, attention_mask=mask)
        sampled = pipeline_generate(stage, ids, mask, SAMPLED, layout, torch.Generator().manual_seed(5))
    assert torch.equal(sampled.sequences, ref_sampled.sequences)  # KV-cache decoding through the uneven stages
    if layout.is_last_stage:
        real = mask.bool()  # padding queries are masked out downstream and differ from HF's
        torch.testing.assert_close(logits[real], ref_logits[real], **FP32)
    loss = Pipeline(stage, layout, n_microbatches=4).train_step(
        ids, _pg_loss_sum, batch["mask"][:, 1:].sum(), attention_mask=mask, batch=batch)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    torch.testing.assert_close(clip_grad_norm_(stage, float("inf"), layout), ref_norm, **FP32)
    for name, p in stage.named_parameters():  # global layer names: local layer i is start + i
        hf_name = _ref_name(stage, name)
        torch.testing.assert_close(p.grad, ref_grads[hf_name], **GRAD_TOL, msg=lambda m: f"{hf_name}: {m}")
    save_hf_checkpoint(stage, out, layout=layout)  # one shard per stage, global layer indices


@pytest.mark.parametrize("pp, split", [(2, StageSplit(stage_layers=(2, 3))), (2, StageSplit(stage_layers=(3, 2))),
                                       (3, StageSplit(first_stage_layers=1, last_stage_layers=1))],
                         ids=["2-3", "3-2", "first1-last1"])
def test_uneven_stages_equal_transformers_and_unpipelined(tmp_path, pp, split):
    """Logits vs LlamaForCausalLM; seeded KV-cache sampling, loss, grad norm and every gradient vs the pp = 1 model;
    the HF export of the stages reloads in transformers with the checkpoint's logits, bit for bit."""
    transformers = pytest.importorskip("transformers")
    hf = make_causal_lm(tmp_path / "lm", "llama3_gqa", num_hidden_layers=LAYERS)
    ids, mask = _padded_batch()
    batch = _pg_batch(ids, mask)
    with torch.no_grad():
        ref_logits = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    dense = from_pretrained(tmp_path / "lm").eval()
    ref_sampled = generate(dense, ids, mask, SAMPLED, torch.Generator().manual_seed(5))
    dense.train()
    ref_loss = _pg_loss_sum(dense(ids, attention_mask=mask), batch) / mask[:, 1:].sum()
    ref_loss.backward()
    ref_grads = {hf_rule(name)[0]: p.grad for name, p in dense.named_parameters()}
    ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values()))
    out = str(tmp_path / "out")
    run_distributed(_check_stage, tmp_path / "lm", pp, split, ids, mask, batch, ref_logits, ref_loss.detach(),
                    ref_grads, ref_norm, ref_sampled, out, world_size=pp)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, rtol=0, atol=0)


# ----- the trainer: config options -> layout -> stages; one step, the export, checkpoints

def _train(run_dir, *overrides):
    train_sft(tiny(run_dir, f"model.num_layers={LAYERS}", "export_hf=true", "model.tie_word_embeddings=false",
                   *overrides))


def _refused_at_another_split(run_dir):
    """A checkpoint of stages [2, 3] does not resume at [3, 2] (local layer names): refused before reading, naming
    both splits and the option; the HF export is the way to another split."""
    model = tiny(run_dir, f"model.num_layers={LAYERS}", "model.pp=2", "model.stage_layers=[3,2]").model
    from megalign.data import CharTokenizer
    from megalign.trainers.supervised import scratch_model
    layout = ParallelLayout.build(pp=2).with_stages(model.stage_split("model"))
    state = {"model": ModelState(scratch_model(model, CharTokenizer(), layout, seed=0), layout)}
    with pytest.raises(ValueError, match=r"saved with pipeline stages of \[2, 3\] layers, but this run splits them "
                                         r"\[3, 2\]; set the role's stage_layers=\[2, 3\]"):
        CheckpointManager(run_dir).load(1, state)


def test_sft_uneven_stages_equal_the_unpipelined_run(tmp_path):
    """SFT from scratch: model.stage_layers=[2, 3] and model.first_stage_layers=3 ([3, 2]) at pp = 2 give the pp = 1
    run's loss, grad norm and trained weights (the exports: global layer names), which transformers reloads."""
    from safetensors.torch import load_file
    run_distributed(_train, str(tmp_path / "ref"), world_size=1)
    ref = load_file(tmp_path / "ref" / "hf" / "model.safetensors")
    ref_rows = _metrics(tmp_path / "ref")
    for name, option in (("23", "model.stage_layers=[2,3]"), ("32", "model.first_stage_layers=3")):
        run_distributed(_train, str(tmp_path / name), "model.pp=2", option, world_size=2)
        with open(tmp_path / name / "hf" / "model.safetensors.index.json") as f:
            weight_map = json.load(f)["weight_map"]
        first = {int(k.split(".")[2]) for k, shard in weight_map.items()
                 if k.startswith("model.layers.") and shard.startswith("model-00001")}
        assert first == set(range(int(name[0])))  # the first stage's layers, named globally
        exported = {}
        for shard in sorted(os.listdir(tmp_path / name / "hf")):
            if shard.endswith(".safetensors"):
                exported.update(load_file(tmp_path / name / "hf" / shard))
        assert sorted(exported) == sorted(ref)
        for key in ref:
            torch.testing.assert_close(exported[key], ref[key], rtol=1e-5, atol=1e-5, msg=key)
        for a, b in zip(ref_rows, _metrics(tmp_path / name)):
            assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(hf_logits(tmp_path / name / "hf"), hf_logits(tmp_path / "ref" / "hf"),
                                   rtol=1e-5, atol=1e-5)
    run_distributed(_refused_at_another_split, str(tmp_path / "23"), world_size=2)


def _metrics(run_dir):
    from trainers.helpers import metric_rows
    return [{k: row[k] for k in ("loss", "grad_norm", "tokens")} for row in metric_rows(run_dir)]


def _train_grpo(policy, run_dir, *overrides):
    from trainers.grpo_helpers import tiny_config
    from megalign.trainers.grpo import train_grpo
    train_grpo(tiny_config(policy, run_dir, "algo.micro_batch_size=4", "algo.kl_coef=0.1", "rollout.pack=false",
                           "rollout.old_logprobs=recompute", "export_hf=true", *overrides))


def test_grpo_uneven_stages_equal_the_unpipelined_run(tmp_path):
    """The online roles take the options too: a 3-layer policy whose actor runs as [2, 1] and reference as [1, 2]
    (first_stage_layers=1) at pp = 2 gives the pp = 1 run's rollouts, metrics and trained weights (the exports)."""
    from safetensors.torch import load_file
    from trainers.grpo_helpers import tiny_policy
    from trainers.helpers import metric_rows
    policy = tiny_policy(tmp_path / "policy", layers=3)
    run_distributed(_train_grpo, policy, str(tmp_path / "ref"), world_size=1)
    run_distributed(_train_grpo, policy, str(tmp_path / "pp2"), "actor.pp=2", "actor.stage_layers=[2,1]",
                    "reference.pp=2", "reference.first_stage_layers=1", world_size=2)
    keys = ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm", "actor/kl", "actor/approx_kl")
    rows = list(zip(metric_rows(tmp_path / "ref"), metric_rows(tmp_path / "pp2"), strict=True))
    assert len(rows) == 2
    assert rows[1][0]["actor/kl"] > 0  # the second step's KL to the [1, 2] reference is live
    for a, b in rows:
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    ref = load_file(tmp_path / "ref" / "hf" / "model.safetensors")
    exported = {}
    for shard in sorted(os.listdir(tmp_path / "pp2" / "hf")):
        if shard.endswith(".safetensors"):
            exported.update(load_file(tmp_path / "pp2" / "hf" / shard))
    assert sorted(exported) == sorted(ref)
    for key in ref:
        torch.testing.assert_close(exported[key], ref[key], rtol=1e-4, atol=1e-5, msg=key)
