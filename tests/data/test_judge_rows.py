"""The embedded judge's rows (`megalign.data.judge_rows`) and its data tool (`megalign.tools.judge_data`).

Oracles: labels worked out by hand for each criterion; the judge role's own `Judge.encode` for the
byte-for-byte identity of an SFT row's prompt and the judge's query; the example configs' YAML."""
import json
import os
import types

import pytest
import yaml
from parallel.dist_utils import run_distributed

from megalign.config import load_config
from megalign.data import ArithProblem, ArithTaskConfig, CharTokenizer, encode_sft, load_prompts, load_sft, make_splits
from megalign.data.judge_rows import (CRITERIA, JUDGE_TEMPLATE, RUBRIC, VERDICTS, balanced, criterion_label,
                                      hard_negatives, judge_items, repeated, reviser_rows, rubric_prompt_rows, sft_row,
                                      synthetic_candidates)
from megalign.rewards.judge import JudgeTemplate, rubric_items
from megalign.rewards.math import have_math_verify
from megalign.roles.judge import Judge, JudgeConfig
from megalign.tools.cai import LabelConfig
from megalign.tools.cai_revise import CritiqueReviseConfig
from megalign.tools.judge_data import (CompareConfig, JudgeDataConfig, _quoted, _read_items, agreement_lines,
                                      comparison_lines, write_judge_data)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("response, correct, boxed, only", [
    ("\\boxed{19}", True, True, True),
    ("\\boxed{18}", False, True, True),  # wrong, but in the box and nothing else
    ("19", False, False, False),  # the verifier reads only a box: an unboxed right number scores 0
    ("answer 19", False, False, False),
    ("\\boxed{19} is the answer", True, True, False),
    ("12+7=\\boxed{18}", False, True, False),
    ("\\boxed{18}\\boxed{19}", True, True, False),  # the last box is the final answer
    ("\\boxed{19", False, False, False),  # unbalanced: no box
    ("", False, False, False),
])
def test_criterion_labels_by_hand(response, correct, boxed, only):
    assert criterion_label("correct", response, 19) is correct
    assert criterion_label("boxed", response, 19) is boxed
    assert criterion_label("only", response, 19) is only


def test_negative_answers_and_unknown_criterion():
    assert criterion_label("correct", "\\boxed{-3}", 2 - 5) and criterion_label("only", "\\boxed{-3}", -3)
    assert not criterion_label("only", "\\boxed{x}", 3)
    with pytest.raises(ValueError, match="'bogus' is not one of"):
        criterion_label("bogus", "\\boxed{1}", 1)


def test_synthetic_candidates_cover_right_wrong_unboxed_and_extra_text():
    for p in make_splits(ArithTaskConfig())[0][:200]:
        right, wrong, unboxed, extra = synthetic_candidates(p, seed=0)
        assert right == f"\\boxed{{{p.answer}}}"
        assert wrong.startswith("\\boxed{") and int(wrong[7:-1]) != p.answer
        assert "\\boxed" not in unboxed and unboxed.split()[-1] in (str(p.answer), wrong[7:-1])
        assert "\\boxed{" in extra and not criterion_label("only", extra, p.answer)
        assert synthetic_candidates(p, seed=0) == [right, wrong, unboxed, extra]  # fixed by (seed, problem)
    problems = make_splits(ArithTaskConfig())[0][:50]
    assert any(synthetic_candidates(p, 0) != synthetic_candidates(p, 1) for p in problems)
    with pytest.raises(ValueError, match="seed"):
        synthetic_candidates(problems[0], seed=-1)


@pytest.mark.parametrize("a, op, b, expected", [
    # 12+7=19 (seed 0): a digit changed at each place, the sign, the two digits swapped, a letter, boxed markup
    (12, "+", 7, ["79", "15", "-19", "91", "W9", "19oxed"]),
    (2, "-", 19, ["-47", "-12", "17", "-71", "-1F", "-1\\boxed7"]),  # negative: the digits after the sign
    # 0: no sign flip, no swap; math-verify reads 0oxed as the product 0 o x e d = 0, right, so it is dropped
    (3, "-", 3, ["2", "e"] + ([] if have_math_verify() else ["0oxed"])),
])
def test_hard_negatives_by_hand(a, op, b, expected):
    p = ArithProblem(a, op, b)
    assert hard_negatives(p, seed=0) == [f"\\boxed{{{n}}}" for n in expected]


def test_hard_negatives_are_one_edit_off_and_wrong():
    problems = make_splits(ArithTaskConfig())[0][:300]
    for p in problems:
        right = str(p.answer)
        for h in hard_negatives(p, seed=0):
            assert h.startswith("\\boxed{") and not criterion_label("correct", h, p.answer)
            number = h[len("\\boxed{"):-1]
            changed = [i for i, (x, y) in enumerate(zip(number, right)) if x != y] if len(number) == len(right) else None
            assert number != right and (changed is not None and len(changed) == 1  # a character replaced
                                        or changed is not None and len(changed) == 2 and sorted(number) == sorted(right)
                                        and changed[1] == changed[0] + 1  # two neighbours swapped
                                        or number.lstrip("-") == right.lstrip("-")  # the sign flipped
                                        or any(m in number for m in ("boxed", "oxed", "box", "{")))
    assert any(hard_negatives(p, 0) != hard_negatives(p, 1) for p in problems)
    with pytest.raises(ValueError, match="seed"):
        hard_negatives(problems[0], seed=-1)


def test_items_and_sft_row_by_hand():
    p = ArithProblem(12, "+", 7)
    items = judge_items(p, ["\\boxed{19}", "so \\boxed{20}", "\\boxed{19}"], "policy")
    assert len(items) == 6  # the repeated response once, three criteria each
    assert [(i["response"], i["key"], i["label"]) for i in items] == [
        ("\\boxed{19}", "correct", True), ("\\boxed{19}", "boxed", True), ("\\boxed{19}", "only", True),
        ("so \\boxed{20}", "correct", False), ("so \\boxed{20}", "boxed", True), ("so \\boxed{20}", "only", False)]
    row = sft_row(items[3], JudgeTemplate(JUDGE_TEMPLATE))
    assert row["prompt"] == "the final answer equals the correct result? 12+7=so \\boxed{20} vs \\boxed{19}\n"
    assert row["response"] == "N" and row["problem"] == "12+7=" and row["candidate"] == "so \\boxed{20}"
    assert sft_row(items[1], JudgeTemplate(JUDGE_TEMPLATE))["response"] == "Y"


def test_balanced_repeats_the_rarer_correct_label():
    p = ArithProblem(12, "+", 7)
    items = judge_items(p, ["\\boxed{19}", "\\boxed{18}", "\\boxed{17}", "\\boxed{16}", "\\boxed{20}"], "policy")
    out = balanced(items, "correct")
    correct = [i["label"] for i in out if i["key"] == "correct"]
    assert correct.count(True) == 4 and correct.count(False) == 4  # 1 right, 4 wrong: the right one 4 times
    assert [i for i in out if i["key"] != "correct"] == [i for i in items if i["key"] != "correct"]
    assert out[:4] == [items[0]] * 4  # in place
    assert balanced(items[:3], "correct") == items[:3]  # one label only: nothing to balance


def test_repeated_writes_the_criterion_rows_times_over_in_place():
    items = judge_items(ArithProblem(2, "+", 2), ["\\boxed{4}", "5"], "synthetic")  # 2 responses x 3 criteria
    out = repeated(items, "correct", 3)
    assert [(i["response"], i["key"]) for i in out] == [("\\boxed{4}", "correct")] * 3 + [
        ("\\boxed{4}", "boxed"), ("\\boxed{4}", "only")] + [("5", "correct")] * 3 + [("5", "boxed"), ("5", "only")]
    assert repeated(items, "correct", 1) == items
    with pytest.raises(ValueError, match="times must be >= 1"):
        repeated(items, "correct", 0)


def test_sft_prompt_is_the_judge_query_byte_for_byte():
    # the judge role (chat_template: false) encodes the filled template with its own method; the SFT loader
    # encodes the row's prompt: the ids must be the same, and the verdict the one token after them
    tok = CharTokenizer()
    row = sft_row(judge_items(ArithProblem(3, "*", 4), ["\\boxed{12}"], "synthetic")[1], JudgeTemplate(JUDGE_TEMPLATE))
    judge = types.SimpleNamespace(cfg=JudgeConfig(path="unused", template=JUDGE_TEMPLATE, chat_template=False),
                                  tokenizer=tok)
    query = JudgeTemplate(JUDGE_TEMPLATE).render({"prompt": "3*4=", "response": "\\boxed{12}", "reference": "12",
                                                  "criterion": CRITERIA["boxed"]})
    example = encode_sft(row["prompt"], row["response"], tok)
    assert example.prompt_ids == Judge.encode(judge, query)
    assert example.response_ids == [tok.encode("Y")[0], tok.eos_id]


def test_example_configs_use_the_rows_template_and_answers():
    with open(os.path.join(ROOT, "examples", "grpo_rubric_arith.yaml")) as f:
        cfg = yaml.safe_load(f)
    (judged,) = cfg["reward"]["judges"]
    assert judged["kind"] == "rubric" and judged["rubric_mode"] == "explicit" and judged["binary"] is True
    assert [t["weight"] for t in cfg["reward"]["terms"]] == [0.0]  # the verifier only watches: the judge is the reward
    assert judged["judge"]["template"] == JUDGE_TEMPLATE and judged["judge"]["answers"] == list(VERDICTS)
    assert judged["judge"]["chat_template"] is False


def test_rubric_rows_load_as_prompts_with_rar_weights(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rubric_prompt_rows([ArithProblem(2, "-", 5)])))
    (example,) = load_prompts(str(path), CharTokenizer(), 16)
    assert example.prompt_text == "2-5=" and example.answer == -3
    items = rubric_items(example.metadata["rubric"], "row 0")
    assert [(i.criterion, i.weight) for i in items] == [(CRITERIA["correct"], 1.0), (CRITERIA["boxed"], 0.7),
                                                        (CRITERIA["only"], 0.3)]
    assert RUBRIC[0]["category"] == "essential"


def _candidate_items(problem):
    """The items `write_judge_data` makes of one problem without a policy: the made-up candidates, then the hard
    negatives that are not among them."""
    synthetic = synthetic_candidates(problem)
    return judge_items(problem, synthetic, "synthetic") + judge_items(
        problem, [h for h in hard_negatives(problem) if h not in synthetic], "hard negative")


def _write(out_dir):
    write_judge_data(JudgeDataConfig(out_dir=out_dir, arith=ArithTaskConfig(max_operand=3), device="cpu"))


def test_write_judge_data_keeps_held_out_problems_apart(tmp_path):
    run_distributed(_write, str(tmp_path), world_size=1, timeout_s=120)
    stamps = {f: os.stat(tmp_path / f).st_mtime_ns for f in os.listdir(tmp_path) if not os.path.isdir(tmp_path / f)}
    run_distributed(_write, str(tmp_path), world_size=1, timeout_s=120)  # a rerun leaves the same files untouched
    assert {f: os.stat(tmp_path / f).st_mtime_ns for f in stamps} == stamps
    train, held_out = make_splits(ArithTaskConfig(max_operand=3))
    rows = {split: [json.loads(line) for line in open(tmp_path / f"judge_{split}.jsonl")] for split in ("train", "held_out")}
    assert {r["problem"] for r in rows["train"]} == {p.prompt for p in train}
    assert {r["problem"] for r in rows["held_out"]} == {p.prompt for p in held_out}
    raw = [i for p in train for i in _candidate_items(p)]
    # the training rows are balanced, then the `correct` ones written correct_repeats (3) times
    assert len(rows["train"]) == len(repeated(balanced(raw, "correct"), "correct", 3)) > len(balanced(raw, "correct"))
    n_correct = sum(i["key"] == "correct" for i in balanced(raw, "correct"))
    assert sum(r["key"] == "correct" for r in rows["train"]) == 3 * n_correct
    # the curriculum's first two stages: the `correct` rows without the hard negatives, then with them
    first_stage = [json.loads(line) for line in open(tmp_path / "judge_train_correct.jsonl")]
    easy = [i for i in raw if i["key"] == "correct" and i["source"] != "hard negative"]
    assert [r["prompt"] for r in first_stage] == [sft_row(i, JudgeTemplate(JUDGE_TEMPLATE))["prompt"]
                                                  for i in balanced(easy, "correct")]
    second_stage = [json.loads(line) for line in open(tmp_path / "judge_train_hard.jsonl")]
    assert [r["prompt"] for r in second_stage] == [r["prompt"] for r in rows["train"] if r["key"] == "correct"][::3]
    assert {r["source"] for r in second_stage} - {r["source"] for r in first_stage} == {"hard negative"}
    assert len(rows["held_out"]) == sum(len(_candidate_items(p)) for p in held_out)  # these are not
    assert {r["source"] for r in rows["held_out"]} == {"synthetic", "hard negative"}
    for r in rows["train"][:30]:
        assert r["response"] == ("Y" if criterion_label(r["key"], r["candidate"], r["answer"]) else "N")
    examples, _ = load_sft(str(tmp_path / "judge_train.jsonl"), CharTokenizer(), 128)  # the judge SFT reads them
    assert len(examples) == len(rows["train"])
    prompts = [json.loads(line) for line in open(tmp_path / "prompts_held_out.jsonl")]
    assert [p["prompt"] for p in prompts] == [p.prompt for p in held_out] and prompts[0]["rubric"] == RUBRIC
    assert len(_read_items(str(tmp_path / "judge_held_out.jsonl"))) == len(rows["held_out"])
    # RLAIF labels from the trained judge: the config loads, its one principle is the `correct` criterion, and the
    # pointwise template renders a (prompt, response, principle) exactly as the judge's SFT row of that criterion
    label = load_config(LabelConfig, str(tmp_path / "label.yaml"), ["judge.path=j", "policy=p"])
    assert label.pointwise and label.principles == [CRITERIA["correct"]] and label.verifier == "math_accuracy"
    row = next(r for r in rows["train"] if r["key"] == "correct")
    fields = {"prompt": row["problem"], "response": row["candidate"], "reference": str(row["answer"]),
              "principle": label.principles[0]}
    assert JudgeTemplate(label.judge.template, "t").render(fields) == row["prompt"]
    # SL-CAI: the reviser's rows use the very templates of the critique-revise config, which loads
    revise = load_config(CritiqueReviseConfig, str(tmp_path / "revise.yaml"), ["policy=p", "reviser=r"])
    assert revise.principles == [CRITERIA["correct"]] and revise.verifier == "math_accuracy"
    reviser = [json.loads(line) for line in open(tmp_path / "reviser_train.jsonl")]
    assert reviser == [r for p in train for r in reviser_rows(p, synthetic_candidates(p))]
    assert load_sft(str(tmp_path / "reviser_train.jsonl"), CharTokenizer(), 128)[0]
    first = reviser[0]
    fields = {"prompt": first["problem"], "response": first["candidate"], "principle": revise.principles[0]}
    assert JudgeTemplate(revise.critique_template, "t").render(fields) == first["prompt"]
    assert JudgeTemplate(revise.revision_template, "t").render({**fields, "critique": first["response"]}) \
        == reviser[1]["prompt"]


def test_reviser_rows_by_hand():
    rows = reviser_rows(ArithProblem(3, "*", 4), ["\\boxed{12}", "\\boxed{13}", "\\boxed{13}"])
    assert [(r["stage"], r["prompt"], r["response"]) for r in rows] == [
        ("critique", CRITERIA["correct"] + "? 3*4=\\boxed{12}\ncritique:", "right"),
        ("revision", "3*4=\\boxed{12}\ncritique:right\nrevision:", "\\boxed{12}"),
        ("critique", CRITERIA["correct"] + "? 3*4=\\boxed{13}\ncritique:", "wrong, it is 12"),
        ("revision", "3*4=\\boxed{13}\ncritique:wrong, it is 12\nrevision:", "\\boxed{12}")]


def test_read_items_names_the_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"problem": "1+1=", "candidate": "2", "criterion": "c", "key": "correct",
                                "source": "synthetic", "label": "yes"}) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: .*bool label"):
        _read_items(str(path))


def test_agreement_lines_by_hand():
    lines = agreement_lines({"all": (7, 8), "criterion correct": (1, 2)})
    assert lines == ["  all                 87.5%  (7/8)", "  criterion correct   50.0%  (1/2)", "judge agreement  87.5%"]


def test_comparison_lines_by_hand():
    # 20% -> 35% (+15) and a control 20% -> 40% (+20): the first run gains 75% of the control's gain
    lines = comparison_lines(0.2, [("DPO, AI labels", 0.35), ("DPO, verifier labels", 0.4)], [("label agreement", 0.912)])
    assert lines == ["held-out accuracy (greedy)",
                     "  initial policy                       20.0%",
                     "  DPO, AI labels                       35.0%  (+15.0 points)",
                     "  DPO, verifier labels                 40.0%  (+20.0 points)",
                     "  gain / DPO, verifier labels's gain   75.0%",
                     "label agreement  91.2%", "change  +15.0 points"]
    assert comparison_lines(0.2, [("a", 0.18), ("control", 0.19)])[-2] == "  gain / control's gain  -"  # no gain to share


def test_quoted_numbers_name_file_and_key(tmp_path):
    path = tmp_path / "label_report.json"
    path.write_text(json.dumps({"train": {"verifier_agreement": 0.9}}))
    assert _quoted(f"{path}:train.verifier_agreement") == 0.9
    with pytest.raises(ValueError, match=r"label_report.json has no 'train.agreement' \(no 'agreement' there\)"):
        _quoted(f"{path}:train.agreement")
    with pytest.raises(ValueError, match="must be 'FILE.json:dotted.key'"):
        CompareConfig(quotes={"label agreement": str(path)})
