"""Verifier-labelled pairs and KTO rows from a policy's own samples: the pairing and labelling rules by hand, and a
2-rank run whose files the RM and KTO loaders read, every pair ordered and every row labelled by the verifier."""
import json
import os
import random

import torch.distributed as dist
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import HERE, digit_fraction, tiny_policy

from megalign.config import load_config
from megalign.data import CharTokenizer, PromptExample, load_preferences, load_unpaired
from megalign.tools.self_pairs import SelfPairsConfig, pairs_of, sample_pairs, unpaired_rows


def test_pairs_of_by_hand():
    example = PromptExample([1, 2], "1+1=", 2, {}, "x")
    responses = ["a", "b", "c", "d", "a", ""]
    finished = [True, True, False, True, True, True]
    scores = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    # passing: "a" (twice: once); "c" is cut off; failing: "b", "d" ("" is no response)
    rows = pairs_of(example, responses, finished, scores, 1.0, 5, random.Random(0))
    assert sorted((r["chosen"], r["rejected"]) for r in rows) == [("a", "b"), ("a", "d")]
    assert all(r["prompt"] == "1+1=" and r["answer"] == 2 for r in rows)
    assert len(pairs_of(example, responses, finished, scores, 1.0, 1, random.Random(0))) == 1
    assert pairs_of(example, ["a", "b"], [True, True], [1.0, 1.0], 1.0, 5, random.Random(0)) == []


def test_unpaired_rows_by_hand():
    example = PromptExample([1, 2], "1+1=", 2, {}, "x")
    responses = ["a", "b", "c", "a", ""]
    finished = [True, True, False, True, True]
    scores = [1.0, 0.5, 1.0, 1.0, 0.0]
    # "c" is cut off, "" is no response; the repeated "a" stays twice; 0.5 < threshold 0.6 is undesirable
    rows = unpaired_rows(example, responses, finished, scores, 0.6)
    assert [(r["completion"], r["label"]) for r in rows] == [("a", True), ("b", False), ("a", True)]
    assert all(r["prompt"] == "1+1=" and r["answer"] == 2 for r in rows)


def _sample(policy, out, *overrides):
    cfg = load_config(SelfPairsConfig, None, [
        *overrides, f"model_path={policy}", f"out_dir={out}", "device=cpu", "data.arith.max_operand=4", "data.arith.ops=['+']",
        "samples_per_prompt=4", "pairs_per_prompt=2", "max_new_tokens=8", f"metric={HERE}/grpo_helpers.py:digit_fraction",
        "threshold=0.2", "batch_size=16",
        "drop_unfinished=false"])  # a random policy rarely samples EOS in 8 tokens
    report = sample_pairs(cfg)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f)


def test_sample_pairs_two_ranks(tmp_path):
    policy = tiny_policy(tmp_path / "policy")
    out = tmp_path / "pairs"
    run_distributed(_sample, policy, str(out))
    report = json.loads((out / "report.json").read_text())
    tok = CharTokenizer()
    for split, name in (("train", "pairs.jsonl"), ("held_out", "pairs_held_out.jsonl")):
        rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
        assert len(rows) == report[split]["pairs"]
        assert report[split]["responses"] == 4 * report[split]["prompts"]
        assert report[split]["paired_prompts"] <= report[split]["prompts"]
        for row in rows:  # the verifier, called again here, orders every pair
            assert digit_fraction(row["prompt"], row["chosen"], row["answer"], {}) >= 0.2
            assert digit_fraction(row["prompt"], row["rejected"], row["answer"], {}) < 0.2
        if rows:  # the RM loader reads every row back
            examples, _ = load_preferences(out / name, tokenizer=tok, max_length=64)
            assert len(examples) == len(rows)
    assert report["train"]["pairs"] > 0  # 20 training prompts: some have a passing and a failing sample
    prompts = {}
    for split, name in (("train", "unpaired.jsonl"), ("held_out", "unpaired_held_out.jsonl")):
        rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
        desirable = [r for r in rows if r["label"]]
        assert (len(desirable), len(rows) - len(desirable)) == (report[split]["desirable"], report[split]["undesirable"])
        assert len(rows) <= report[split]["responses"]  # every non-empty sample once (drop_unfinished false)
        for row in rows:  # the verifier, called again here, gives every label
            assert row["label"] is (digit_fraction(row["prompt"], row["completion"], row["answer"], {}) >= 0.2)
        examples, _ = load_unpaired(out / name, tokenizer=tok, max_length=64)
        assert len(examples) == len(rows)
        prompts[split] = {r["prompt"] for r in rows}
    assert report["train"]["desirable"] > 0 and report["train"]["undesirable"] > 0
    assert not prompts["train"] & prompts["held_out"]  # the held-out rows come from other problems


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_unpaired_prompts_paired_keeps_the_prompts_with_a_pair(tmp_path):
    policy = tiny_policy(tmp_path / "policy")
    run_distributed(_sample, policy, str(tmp_path / "all"))
    run_distributed(_sample, policy, str(tmp_path / "paired"), "unpaired_prompts=paired")
    for suffix in ("_held_out", ""):  # the same seeded samples: the pairs alike, the KTO rows those of paired prompts
        assert _rows(tmp_path / "paired" / f"pairs{suffix}.jsonl") == _rows(tmp_path / "all" / f"pairs{suffix}.jsonl")
        paired = {r["prompt"] for r in _rows(tmp_path / "all" / f"pairs{suffix}.jsonl")}
        expected = [r for r in _rows(tmp_path / "all" / f"unpaired{suffix}.jsonl") if r["prompt"] in paired]
        key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
        assert sorted(map(key, _rows(tmp_path / "paired" / f"unpaired{suffix}.jsonl"))) == sorted(map(key, expected))
    assert expected and len(expected) < len(_rows(tmp_path / "all" / "unpaired.jsonl"))  # training rows left out
