"""Offline alignment data of the arithmetic task: preference pairs, unpaired KTO rows, stepwise PRM solutions.

Oracles: `math_accuracy` for right and wrong answers, Python's `eval` for every expression and step."""
import math
import re

import pytest

from megalign.algos import kto_weight_ratio
from megalign.data import (
    ArithChain,
    ArithChainConfig,
    ArithProblem,
    ArithTaskConfig,
    CharTokenizer,
    chain_steps,
    corrupt_chain_steps,
    load_preferences,
    load_prompts,
    load_stepwise,
    load_unpaired,
    make_chain_splits,
    make_splits,
    preference_rows,
    stepwise_rows,
    unpaired_rows,
    write_jsonl,
    write_preference_jsonl,
    write_stepwise_jsonl,
    write_unpaired_jsonl,
    wrong_answer,
)
from megalign.rewards import extract_answer, math_accuracy

CFG = ArithTaskConfig()
TRAIN = make_splits(CFG)[0]
TOK = CharTokenizer()


def test_pairs_chosen_right_rejected_wrong_margin_by_formula():
    rows = preference_rows(TRAIN, seed=0)
    assert len(rows) == len(TRAIN) == 1058
    slips = offsets = 0
    for p, row in zip(TRAIN, rows):
        assert (row["prompt"], row["chosen"], row["answer"]) == (p.prompt, p.response, p.answer)
        assert math_accuracy(row["chosen"], p.answer) == 1.0 and math_accuracy(row["rejected"], p.answer) == 0.0
        assert re.fullmatch(r"\\boxed\{-?\d+\}", row["rejected"])  # the same format as the SFT response
        wrong = int(extract_answer(row["rejected"]))
        assert row["margin"] == math.log1p(abs(wrong - p.answer))
        assert math.log(2) <= row["margin"] <= math.log1p(max(3, CFG.max_operand ** 2))
        others = {eval(f"{p.a}{op}{p.b}") for op in "+-*" if op != p.op}
        slips += wrong in others
        offsets += 0 < abs(wrong - p.answer) <= 3
        assert wrong in others or 0 < abs(wrong - p.answer) <= 3
    assert 0.4 < slips / len(rows) < 0.6 and 0.4 < offsets / len(rows) < 0.65  # about half each (they may overlap)


def test_pairs_are_deterministic_per_problem_and_seed():
    rows = preference_rows(TRAIN, seed=0)
    assert preference_rows(TRAIN, seed=0) == rows
    assert preference_rows(TRAIN[100:110], seed=0) == rows[100:110]  # a problem's pair does not depend on the list
    assert preference_rows(TRAIN, seed=1) != rows
    assert wrong_answer(ArithProblem(2, "+", 2), 0) != 4  # 2+2 = 2*2: no slip differs from 4 there but 2-2
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        wrong_answer(TRAIN[0], -1)


def test_written_pairs_load_with_the_prompt_ids_of_every_other_stage(tmp_path):
    problems = make_splits(ArithTaskConfig(max_operand=5))[0]
    write_preference_jsonl(problems, tmp_path / "pairs.jsonl", seed=3)
    write_jsonl(problems, tmp_path / "prompts.jsonl")
    pairs, stats = load_preferences(tmp_path / "pairs.jsonl", TOK, 32)
    prompts = load_prompts(tmp_path / "prompts.jsonl", TOK, 16)
    assert stats.kept == len(problems)
    assert [e.prompt_ids for e in pairs] == [e.prompt_ids for e in prompts]
    assert [TOK.decode(e.chosen_ids) for e in pairs] == [p.response for p in problems]
    assert [e.answer for e in pairs] == [p.answer for p in problems]
    assert [e.margin for e in pairs] == [r["margin"] for r in preference_rows(problems, seed=3)]


def test_unpaired_rows_balanced_and_labelled_by_correctness(tmp_path):
    rows = unpaired_rows(TRAIN, seed=0)
    labels = [r["label"] for r in rows]
    assert sum(labels) == math.ceil(len(rows) / 2)
    assert 1.0 <= kto_weight_ratio(sum(labels), len(labels) - sum(labels)) <= 4 / 3
    pairs = preference_rows(TRAIN, seed=0)
    for p, row, pair in zip(TRAIN, rows, pairs):
        assert math_accuracy(row["completion"], p.answer) == float(row["label"])
        assert row["completion"] == (pair["chosen"] if row["label"] else pair["rejected"])
    assert unpaired_rows(TRAIN, seed=0) == rows and unpaired_rows(TRAIN, seed=1) != rows
    assert sum(r["label"] for r in unpaired_rows(TRAIN[:7], seed=5)) == 4
    write_unpaired_jsonl(TRAIN[:20], tmp_path / "kto.jsonl")
    examples, _ = load_unpaired(tmp_path / "kto.jsonl", TOK, 32)
    assert [e.label for e in examples] == [r["label"] for r in unpaired_rows(TRAIN[:20])]


def _tokens(expression):
    """[3, '+', 4, ...] of an expression such as '-10+4*2' (only the first number may be negative)."""
    return [int(t) if t[-1].isdigit() else t for t in re.findall(r"^-\d+|\d+|[-+*]", expression)]


def _value(tokens):
    return eval("".join(str(t) for t in tokens))


def replay(prompt, steps):
    """Check each step reduces one operation of the expression without changing its value (eval is the oracle)
    and return (arithmetic right per operation step, the last value, the boxed answer)."""
    tokens, right = _tokens(prompt[:-1]), []
    for step in steps[:-1]:
        lhs, result = step.split("=")
        left, op, r = re.fullmatch(r"(-?\d+)([-+*])(\d+)", lhs).groups()
        triple = [int(left), op, int(r)]
        spots = [j for j in range(0, len(tokens) - 2, 2) if tokens[j:j + 3] == triple
                 and _value(tokens[:j] + [eval(lhs)] + tokens[j + 3:]) == _value(tokens)]
        assert spots, f"{step!r} reduces no operation of {tokens} in order"
        right.append(eval(lhs) == int(result))
        tokens = tokens[:spots[0]] + [int(result)] + tokens[spots[0] + 3:]
    assert len(tokens) == 1
    return right, tokens[0], extract_answer(steps[-1])


def test_chain_solution_by_hand_and_corruption_by_hand():
    chain = ArithChain((3, 4, 2, 1), ("+", "*", "-"))
    assert chain.prompt == "3+4*2-1=" and chain.answer == 10
    assert chain.response == "4*2=8\n3+8=11\n11-1=10\n\\boxed{10}"
    assert corrupt_chain_steps(chain, 1, 2) == (["4*2=8", "3+8=13", "13-1=12", "\\boxed{12}"],
                                                [True, False, False, False])
    assert chain_steps(ArithChain((9, 7, 7, 8), ("-", "-", "*"))) == ["7*8=56", "9-7=2", "2-56=-54", "\\boxed{-54}"]
    with pytest.raises(ValueError, match="offset must be nonzero"):
        corrupt_chain_steps(chain, 0, 0)
    with pytest.raises(ValueError, match=r"wrong_step must be in \[0, 3\)"):
        corrupt_chain_steps(chain, 3, 1)


def test_chain_splits_are_fixed_distinct_and_disjoint():
    cfg = ArithChainConfig(num_problems=500)
    train, held_out = make_chain_splits(cfg)
    assert (len(train), len(held_out)) == (400, 100)
    assert len(set(train) | set(held_out)) == 500
    assert make_chain_splits(ArithChainConfig(num_problems=500)) == (train, held_out)
    assert make_chain_splits(ArithChainConfig(num_problems=500, seed=1))[1] != held_out
    assert {len(ch.ops) for ch in train} == {2, 3} and min(min(ch.operands) for ch in train) >= 1
    with pytest.raises(ValueError, match=r"num_problems must be in \[2, 8\]"):
        ArithChainConfig(min_ops=1, max_ops=1, max_operand=2, ops=["+", "*"], num_problems=9)
    small = make_chain_splits(ArithChainConfig(min_ops=1, max_ops=1, max_operand=2, ops=["+", "*"], num_problems=8))
    assert len(small[0]) + len(small[1]) == 8  # every expression of the config, drawn to the end


def test_stepwise_solutions_evaluate_correctly_and_corruptions_are_labelled():
    chains = make_chain_splits(ArithChainConfig(num_problems=600))[0]
    rows = stepwise_rows(chains, seed=0)
    corrupted = 0
    for chain, row in zip(chains, rows):
        assert eval(row["prompt"][:-1]) == row["answer"] == chain.answer
        right, last, boxed = replay(row["prompt"], row["completions"])
        assert len(row["completions"]) == len(row["labels"]) == len(chain.ops) + 1
        assert int(boxed) == last
        if all(row["labels"]):
            assert all(right) and last == chain.answer
            assert row["completions"] == chain_steps(chain)
        else:
            k = row["labels"].index(False)
            assert row["labels"] == [i < k for i in range(len(row["labels"]))]
            assert right == [i != k for i in range(len(chain.ops))]  # step k wrong, the others faithful
            assert math_accuracy(row["completions"][-1], chain.answer) == 0.0
            corrupted += 1
    assert 0.4 < corrupted / len(rows) < 0.6
    assert stepwise_rows(chains, seed=0) == rows and stepwise_rows(chains[:5], seed=0) == rows[:5]
    assert all(all(r["labels"]) for r in stepwise_rows(chains, seed=0, corrupt_fraction=0.0))
    assert not any(r["labels"][-1] for r in stepwise_rows(chains, seed=0, corrupt_fraction=1.0))


def test_a_corrupted_product_never_goes_negative():
    chain = ArithChain((5, 1, 1), ("-", "*"))  # 1*1 = 1 corrupted by -2 or -3 would read 5--1=6
    steps = [s for seed in range(200) for s in stepwise_rows([chain], seed, corrupt_fraction=1.0)[0]["completions"]]
    assert "1*1=0" in steps and not [s for s in steps if re.search(r"[-+*]-", s)]


def test_written_stepwise_rows_load_with_one_position_per_step(tmp_path):
    chains = make_chain_splits(ArithChainConfig(num_problems=50))[1]
    write_stepwise_jsonl(chains, tmp_path / "prm.jsonl", seed=2)
    examples, stats = load_stepwise(tmp_path / "prm.jsonl", TOK, 128)
    rows = stepwise_rows(chains, seed=2)
    assert stats.kept == len(chains)
    for example, row in zip(examples, rows):
        assert example.labels == [float(y) for y in row["labels"]]
        assert [example.ids[j] for j in example.step_positions] == TOK.encode("\n") * len(row["completions"])
        assert TOK.decode(example.ids) == row["prompt"] + "".join(s + "\n" for s in row["completions"])
