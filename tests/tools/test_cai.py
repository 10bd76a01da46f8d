"""Constitutional AI / RLAIF tools (megalign.tools.cai, megalign.tools.cai_revise) on tiny random models.

References: the judge's label probability against `transformers` forwards of the same judge prompts in both orders
(p(A) = softmax over the two answer logits at the last prompt token, averaged as (p_ab + 1 - p_ba) / 2); the
verifier preference against the verifier called again here; principles against `random.Random(f"{seed}/{split}/{i}")`
drawn by hand; one process against two, an interrupted-then-resumed run against an uninterrupted one (byte for byte);
the rows loaded and trained on (one step) by megalign's DPO and SFT trainers.
"""
import json
import math
import os
import random
from collections import Counter

import pytest
import torch
from parallel.dist_utils import RankFailure, run_distributed
from rewards.test_judge import CHAR, hand_p_yes, random_judge, set_logit_judge
from trainers.grpo_helpers import HERE, digit_fraction, tiny_policy
from trainers.test_dpo import dpo_config
from trainers.test_sft import tiny_config as sft_config
from transformers import AutoModelForCausalLM

from megalign.config import ConfigError, load_config
from megalign.tools.cai import STOP_ENV, LabelConfig, _pair_verdict, label, load_constitution
from megalign.tools.cai_revise import CritiqueReviseConfig, critique_revise
from megalign.trainers.preference import train_dpo
from megalign.trainers.sft import train_sft

VERIFIER = f"{HERE}/grpo_helpers.py:digit_fraction"
JUDGE_TEMPLATE = "{prompt}|{response_a}|{response_b}|{principle}>"
POINTWISE = "{principle}? {prompt}|{reference}|{response}"  # ends with the response: the logit judge's p(Y) varies
PRINCIPLES = ["be brief", "be right", "use digits"]
CRITIQUE, REVISION = "{prompt}{response}|{principle}?", "{prompt}{response}|{principle}|{critique}!"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cai_models")
    constitution = root / "constitution.txt"
    constitution.write_text("".join(p + "\n" for p in PRINCIPLES))
    random_judge(root / "judge")
    return {"policy": tiny_policy(root / "policy"), "judge": str(root / "judge"), "constitution": str(constitution)}


def _label_overrides(models, out, *extra):
    return [f"policy={models['policy']}", f"out_dir={out}", "device=cpu", "data.arith.max_operand=4",
            "data.arith.ops=['+']", "max_new_tokens=6", "chunk_size=3", "drop_unfinished=false", "held_out=true",
            f"constitution={models['constitution']}", f"verifier={VERIFIER}", f"judge.path={models['judge']}",
            f"judge.template={JUDGE_TEMPLATE}", "judge.answers=[A, B]", "judge.chat_template=false", *extra]


def _revise_overrides(models, out, *extra):
    return [f"policy={models['policy']}", f"out_dir={out}", "device=cpu", "data.arith.max_operand=4",
            "data.arith.ops=['+']", "max_new_tokens=6", "critique_max_new_tokens=5", "chunk_size=4", "rounds=2",
            "drop_unfinished=false", f"constitution={models['constitution']}", f"verifier={VERIFIER}",
            f"critique_template={CRITIQUE}", f"revision_template={REVISION}", *extra]


def _run(tool, config_cls, overrides, stop_after=0):
    """`tool` on the config of `overrides` (every rank); rank 0 writes its report to out_dir/report.json."""
    if stop_after:
        os.environ[STOP_ENV] = str(stop_after)
    try:
        report = tool(load_config(config_cls, None, overrides))
    finally:
        os.environ.pop(STOP_ENV, None)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(load_config(config_cls, None, overrides).out_dir, "report.json"), "w") as f:
            json.dump(report, f)


def _label(overrides, stop_after=0):
    _run(label, LabelConfig, overrides, stop_after)


def _files(out):
    return {name: (out / name).read_bytes() for name in ("pairs.jsonl", "pairs_verifier.jsonl",
                                                         "pairs_held_out.jsonl", "pairs_verifier_held_out.jsonl")}


def _hf_p_a(judge, text):
    """p(A) / (p(A) + p(B)) after BOS + `text` from a transformers forward of the judge."""
    ids = torch.tensor([CHAR.encode(text, add_bos=True)])
    with torch.no_grad():
        logits = judge(ids).logits[0, -1]
    pair = logits[[CHAR.encode("A")[0], CHAR.encode("B")[0]]].double()
    return torch.softmax(pair, -1)[0].item()


def test_label_rows_resume_and_two_processes(models, tmp_path):
    straight, resumed, two = tmp_path / "straight", tmp_path / "resumed", tmp_path / "two"
    run_distributed(_label, _label_overrides(models, straight), world_size=1)
    with pytest.raises(RankFailure, match="stopped after 2 chunks"):  # a crash after 2 of the 7 train chunks
        run_distributed(_label, _label_overrides(models, resumed), 2, world_size=1)
    assert not (resumed / "pairs.jsonl").exists()
    assert len(os.listdir(resumed / "chunks" / "label-train")) == 2
    run_distributed(_label, _label_overrides(models, resumed))  # resumed on 2 processes
    run_distributed(_label, _label_overrides(models, two))
    assert _files(straight) == _files(resumed) == _files(two)
    with pytest.raises(RankFailure, match="other values of tie_tolerance"):  # chunks of another config are not mixed in
        run_distributed(_label, _label_overrides(models, straight, "tie_tolerance=0.1"), world_size=1)

    report = json.loads((straight / "report.json").read_text())
    assert json.loads((straight / "label_report.json").read_text()) == report  # the file a pipeline's table quotes
    rows = [json.loads(line) for line in (straight / "pairs.jsonl").read_text().splitlines()]
    train = report["train"]
    assert train["prompts"] == 20 and train["responses"] == 40
    left_out = sum(train.get(k, 0) for k in ("unfinished", "empty", "identical", "unparsed", "ties"))
    assert train["pairs"] == len(rows) == 20 - left_out and len(rows) >= 10
    assert len({r["prompt"] for r in rows}) == len(rows)  # one pair a prompt: no duplicate

    judge = AutoModelForCausalLM.from_pretrained(models["judge"]).eval()
    prompts = [json.loads(line)["prompt"] for line in (straight / "data" / "arith_train.jsonl").read_text().splitlines()]
    agree = decided = 0
    for row in rows:
        i = prompts.index(row["prompt"])
        assert row["principle"] == random.Random(f"0/train/{i}").choice(PRINCIPLES)
        c, r = row["chosen"], row["rejected"]
        p_cr = _hf_p_a(judge, JUDGE_TEMPLATE.format(prompt=row["prompt"], response_a=c, response_b=r,
                                                    principle=row["principle"]))
        p_rc = _hf_p_a(judge, JUDGE_TEMPLATE.format(prompt=row["prompt"], response_a=r, response_b=c,
                                                    principle=row["principle"]))
        q = (p_cr + 1 - p_rc) / 2
        assert row["label_probability"] == pytest.approx(q, abs=1e-5) and q > 0.5
        assert row["margin"] == pytest.approx(math.log(q / (1 - q)), abs=1e-4)
        v_c, v_r = (digit_fraction(row["prompt"], t, None, {}) for t in (c, r))
        assert row["verifier_preference"] == (None if v_c == v_r else int(v_c > v_r))
        decided += v_c != v_r
        agree += v_c > v_r
    assert train["verifier_decided"] == decided and train["verifier_agreement"] == pytest.approx(agree / decided)
    control = [json.loads(line) for line in (straight / "pairs_verifier.jsonl").read_text().splitlines()]
    assert all(digit_fraction(x["prompt"], x["chosen"], None, {}) > digit_fraction(x["prompt"], x["rejected"], None, {})
               for x in control) and len(control) >= decided

    # the rows train megalign's DPO trainer for a step
    run_distributed(lambda: train_dpo(dpo_config(models["policy"], str(tmp_path / "dpo"), "steps=1", "batch_size=4",
                                                 f"data.path={straight}/pairs.jsonl", "save_every=0")), world_size=1)
    assert json.loads((tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_pair_verdict_by_hand():
    # p(a better) = (p(A | a, b) + 1 - p(A | b, a)) / 2: a judge that always says A (pure position bias) ties
    assert _pair_verdict(0.8, 0.4, True) == pytest.approx(0.7)
    assert _pair_verdict(0.9, 0.9, True) == pytest.approx(0.5)
    assert _pair_verdict(0.2, 0.6, True) == pytest.approx(0.3)
    assert _pair_verdict(0.8, 0.4, False) is None and _pair_verdict(1.5, 0.4, True) is None
    # pointwise: p = s_a (1 - s_b) / (s_a (1 - s_b) + s_b (1 - s_a)); 0.8 * 0.6 = 0.48 against 0.4 * 0.2 = 0.08
    assert _pair_verdict(0.8, 0.4, True, pointwise=True) == pytest.approx(0.48 / 0.56)
    assert _pair_verdict(1.0, 0.0, True, pointwise=True) == 1.0 and _pair_verdict(0.3, 0.3, True, True) == 0.5
    assert _pair_verdict(0.0, 0.0, True, True) == 0.5 and _pair_verdict(1.0, 1.0, True, True) == 0.5


def test_label_pointwise_judge_by_hand(models, tmp_path):
    out = tmp_path / "pointwise"
    set_logit_judge(tmp_path / "logit")  # p(Y) a closed form of the last token (hand_p_yes)
    run_distributed(_label, _label_overrides(models, out, f"judge.template={POINTWISE}", "held_out=false",
                                             "pairs_per_prompt=2", f"judge.path={tmp_path / 'logit'}",
                                             "judge.answers=[Y, N]"), world_size=1)
    rows = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    report = json.loads((out / "report.json").read_text())["train"]
    assert report["responses"] == 4 * report["prompts"] and "position_consistent" not in report
    per_prompt = Counter(r["prompt"] for r in rows)  # two pairs a prompt, each with its own draw from the stream
    assert max(per_prompt.values()) == 2 and report["ties"] > 0 and len(rows) >= 10
    prompts = [json.loads(line)["prompt"] for line in (out / "data" / "arith_train.jsonl").read_text().splitlines()]
    for row in rows:
        stream = random.Random(f"0/train/{prompts.index(row['prompt'])}")
        assert row["principle"] in [stream.choice(PRINCIPLES) for _ in range(2)]
    for row in rows:
        s_c, s_r = (hand_p_yes(POINTWISE.format(prompt=row["prompt"], response=t, principle=row["principle"],
                                                reference=row["answer"])) for t in (row["chosen"], row["rejected"]))
        q = s_c * (1 - s_r) / (s_c * (1 - s_r) + s_r * (1 - s_c))
        assert row["label_probability"] == pytest.approx(q, abs=1e-5) and q > 0.5
        assert s_c >= 0.5 > s_r  # the judge separates the pair; pairs on one side of 1/2 are ties
        assert sorted(row["judge_scores"]) == pytest.approx(sorted([s_c, s_r]), abs=1e-5)
    # accept_at between the chosen verdicts: the pairs whose accepted side scores below it move to `unsure`
    accept_at = sorted(max(r["judge_scores"]) for r in rows)[len(rows) // 2] - 1e-6
    run_distributed(_label, _label_overrides(models, tmp_path / "strict", f"judge.template={POINTWISE}",
                                             "held_out=false", "pairs_per_prompt=2", f"judge.path={tmp_path / 'logit'}",
                                             "judge.answers=[Y, N]", f"accept_at={accept_at}"), world_size=1)
    strict = [json.loads(line) for line in (tmp_path / "strict" / "pairs.jsonl").read_text().splitlines()]
    sure = [r for r in rows if max(r["judge_scores"]) >= accept_at]
    assert strict == sure and 0 < len(strict) < len(rows)
    strict_report = json.loads((tmp_path / "strict" / "report.json").read_text())["train"]
    assert strict_report["unsure"] == len(rows) - len(sure) and strict_report["ties"] == report["ties"]



def test_constitution_and_template_errors(models, tmp_path):
    def fails(text, name, match):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_constitution(str(path))

    fails("", "empty.txt", "empty.txt is empty")
    fails("be brief\n\nbe right\n", "gap.txt", r"gap.txt:2 is an empty line")
    fails("be brief\n  \n", "blank.txt", r"blank.txt:2 is an empty line")
    fails('{"a": 1}', "c.json", "non-empty list")
    fails("- be brief\n- ''\n", "c.yaml", "item 1 must be a non-empty string")
    assert load_constitution(models["constitution"]) == PRINCIPLES
    (tmp_path / "ok.json").write_text(json.dumps(PRINCIPLES))
    assert load_constitution(str(tmp_path / "ok.json")) == PRINCIPLES

    base = _label_overrides(models, tmp_path / "x")
    with pytest.raises(ConfigError, match=r"\{respnse_a\}.*did you mean \{response_a\}"):
        load_config(LabelConfig, None, base + ["judge.template={prompt} {respnse_a} {response_b}"])
    with pytest.raises(ConfigError, match=r"\{principle\} is not one that label without a constitution supplies"):
        load_config(LabelConfig, None, [o for o in base if not o.startswith("constitution=")])
    with pytest.raises(ConfigError, match=r"\{response_b\} is not one that label supplies"):  # pointwise: one slot
        load_config(LabelConfig, None, base + ["judge.template={response} {response_b} {principle}"])
    with pytest.raises(ConfigError, match="needs the field {response_b}"):
        load_config(LabelConfig, None, base + ["judge.template={prompt} {response_a}"])
    with pytest.raises(ConfigError, match=r"gap.txt:2"):
        load_config(LabelConfig, None, base + [f"constitution={tmp_path / 'gap.txt'}"])
    with pytest.raises(ConfigError, match=r"accept_at applies to a pointwise judge"):
        load_config(LabelConfig, None, base + ["accept_at=0.9"])
    with pytest.raises(ConfigError, match=r"accept_at must be in \[0.5, 1\], got 0.4"):
        load_config(LabelConfig, None, base + ["judge.template={principle} {response}", "accept_at=0.4"])


def _hf_greedy(model, text, max_new_tokens):
    """transformers greedy generate after BOS + `text` (no padding), decoded by the char tokenizer."""
    ids = torch.tensor([CHAR.encode(text, add_bos=True)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=CHAR.eos_id, pad_token_id=CHAR.pad_id)
    return CHAR.decode(out[0, ids.shape[1]:].tolist())


def test_critique_revise_rows_against_transformers_and_sft(models, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    run_distributed(_run, critique_revise, CritiqueReviseConfig, _revise_overrides(models, one), world_size=1)
    run_distributed(_run, critique_revise, CritiqueReviseConfig, _revise_overrides(models, two))
    assert (one / "sft.jsonl").read_bytes() == (two / "sft.jsonl").read_bytes()
    report = json.loads((one / "report.json").read_text())["train"]
    rows = [json.loads(line) for line in (one / "sft.jsonl").read_text().splitlines()]
    assert report["prompts"] == 20 and report["rows"] == len(rows) == 20 - report.get("empty", 0)

    policy = AutoModelForCausalLM.from_pretrained(models["policy"]).eval()
    prompts = [json.loads(line)["prompt"] for line in (one / "data" / "arith_train.jsonl").read_text().splitlines()]
    accepted = 0
    for row in rows:  # every critique and revision is the policy's greedy answer to the filled template
        stream = random.Random(f"0/train/{prompts.index(row['prompt'])}")
        response = row["initial_response"]
        assert len(row["revisions"]) == 2
        for step in row["revisions"]:
            fields = dict(prompt=row["prompt"], response=response, principle=stream.choice(PRINCIPLES))
            assert step["principle"] == fields["principle"]
            assert step["critique"] == _hf_greedy(policy, CRITIQUE.format(**fields), 5)
            revision = _hf_greedy(policy, REVISION.format(critique=step["critique"], **fields), 6)
            assert step["revision"] == revision and step["accepted"] == bool(revision.strip())
            response = revision if step["accepted"] else response
            accepted += step["accepted"]
        assert row["response"] == row["completion"] == response
        assert row["initial_score"] == digit_fraction(row["prompt"], row["initial_response"], None, {})
        assert row["final_score"] == digit_fraction(row["prompt"], response, None, {})
    assert accepted > 0 and report["rejected_revisions"] == 2 * len(rows) - accepted
    assert report["final_accuracy"] == pytest.approx(sum(r["final_score"] for r in rows) / len(rows))
    assert report["initial_accuracy"] == pytest.approx(sum(r["initial_score"] for r in rows) / len(rows))
    control = [json.loads(line) for line in (one / "sft_initial.jsonl").read_text().splitlines()]  # the ablation
    assert control == [{"prompt": r["prompt"], "response": r["initial_response"], "completion": r["initial_response"],
                        "answer": r["answer"]} for r in rows if r["initial_response"].strip()]
    assert len(control) == len(rows) - report.get("initial_empty", 0)

    # the rows train megalign's SFT trainer for a step
    run_distributed(lambda: train_sft(sft_config(str(tmp_path / "sft"), f"data.path={one}/sft.jsonl", "steps=1",
                                                 "batch_size=4", "save_every=0")), world_size=1)
    assert json.loads((tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_critique_revise_config_errors(models, tmp_path):
    base = _revise_overrides(models, tmp_path / "x")
    with pytest.raises(ConfigError, match="needs a constitution"):
        load_config(CritiqueReviseConfig, None, [o for o in base if not o.startswith("constitution=")])
    with pytest.raises(ConfigError, match=r"revision_template: field \{critiqe\}.*did you mean \{critique\}"):
        load_config(CritiqueReviseConfig, None, base + ["revision_template={response} {critiqe}"])
    with pytest.raises(ConfigError, match=r"critique_template: critique-revise's critique needs the field \{principle\}"):
        load_config(CritiqueReviseConfig, None, base + ["critique_template={prompt} {response}"])
    (tmp_path / "empty.yaml").write_text("\n")
    with pytest.raises(ConfigError, match="empty.yaml is empty"):
        load_config(CritiqueReviseConfig, None, base + [f"constitution={tmp_path / 'empty.yaml'}"])
