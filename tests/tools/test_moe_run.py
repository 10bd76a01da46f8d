"""The embedded MoE run's own steps (`megalign.tools.moe_run`): the from-scratch folder against transformers (its
architecture, the active width of the dense control, its logits reloaded by `transformers` against megalign's), and
the summary table against hand-worked means of written metrics."""
import json
import os

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from megalign.config import load_config
from megalign.data import CharTokenizer
from megalign.models import from_pretrained
from megalign.tools.moe_run import MoERunSummaryConfig, ScratchMoEConfig, summarize_moe_run, write_scratch_moe


SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "num_experts=4",
         "experts_per_token=2", "moe_intermediate_size=16", "seed=3"]


def test_scratch_moe_loads_in_transformers_with_the_same_logits(tmp_path):
    path = write_scratch_moe(load_config(ScratchMoEConfig, None, [f"out={tmp_path}/moe", *SMALL]))
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert (hf.config.num_experts, hf.config.num_experts_per_tok, hf.config.moe_intermediate_size) == (4, 2, 16)
    assert hf.config.vocab_size == CharTokenizer().vocab_size and hf.config.head_dim == 16
    experts = hf.model.layers[1].mlp.experts
    assert 0.015 < float(experts.gate_up_proj.detach().std()) < 0.025  # drawn from N(0, init_std = 0.02)
    ids = torch.tensor([CharTokenizer().encode("12+7=19")])
    ours = from_pretrained(path).eval()
    with torch.no_grad():
        assert_close(ours.lm_head(ours.model(ids)).float(), hf(ids).logits, rtol=1e-4, atol=1e-5)
    again = write_scratch_moe(load_config(ScratchMoEConfig, None, [f"out={tmp_path}/again", *SMALL]))
    for (name, a), b in zip(hf.named_parameters(), AutoModelForCausalLM.from_pretrained(again).parameters()):
        assert torch.equal(a, b), name  # the seed fixes the folder


def _metrics(run_dir, rows):
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(run_dir)


def test_summary_reads_before_after_and_mismatch_means(tmp_path):
    sft = _metrics(tmp_path / "sft", [{"step": 10, "loss": 1.0}, {"step": 10, "eval/accuracy": 0.25}])
    step = {"rollout/logprob_max_abs_diff": 1e-6, "rollout/logprob_k3": 2e-14, "rollout/logprob_bitwise_equal": 0.5}
    grpo = _metrics(tmp_path / "grpo", [
        {"step": 1, **step, "moe/router_agreement": 0.9},
        {"step": 2, **step, "rollout/logprob_max_abs_diff": 3e-6, "moe/router_agreement": 0.8},
        {"step": 2, "eval/accuracy": 0.375}])
    table = summarize_moe_run(load_config(MoERunSummaryConfig, None, [
        f"sft={{moe: {sft}}}", f"grpo={{moe_no_replay: {grpo}}}", "start={moe_no_replay: moe}",
        f"summary_path={tmp_path}/summary.json"]))
    row = table["moe_no_replay"]
    assert (row["before"], row["after"], row["steps"]) == (0.25, 0.375, 2) and row["gain"] == pytest.approx(12.5)
    assert row["rollout/logprob_max_abs_diff"] == pytest.approx(2e-6)
    assert row["moe/router_agreement"] == pytest.approx(0.85) and row["rollout/logprob_bitwise_equal"] == 0.5
    with open(tmp_path / "summary.json") as f:
        assert json.load(f) == table
    with pytest.raises(ValueError, match=r"start\.moe_no_replay: name the SFT run"):
        MoERunSummaryConfig(sft={"moe": sft}, grpo={"moe_no_replay": grpo}, start={})
