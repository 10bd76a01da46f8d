"""The embedded arithmetic task: correct answers, a disjoint fixed split, and a file the loader reads."""
import pytest

from megalign.data import ArithProblem, ArithTaskConfig, CharTokenizer, load_prompts, make_splits, write_jsonl
from megalign.rewards import math_accuracy


def test_problems_render_and_answer_correctly():
    assert ArithProblem(12, "+", 7).prompt == "12+7="
    assert ArithProblem(3, "-", 17).answer == -14
    assert ArithProblem(13, "*", 11).answer == 143
    assert ArithProblem(13, "*", 11).response == "\\boxed{143}"
    assert math_accuracy(ArithProblem(3, "-", 17).response, -14) == 1.0  # the SFT target earns the reward


def test_split_is_fixed_disjoint_and_complete():
    cfg = ArithTaskConfig()
    train, held_out = make_splits(cfg)
    assert (len(train), len(held_out)) == (1058, 265)  # 3 ops * 21 * 21 = 1323; round(0.2 * 1323) = 265
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    assert len({p.prompt for p in train + held_out}) == 1323
    assert make_splits(ArithTaskConfig()) == (train, held_out)
    assert make_splits(ArithTaskConfig(seed=1))[1] != held_out
    for p in train[:50] + held_out[:50]:
        a, b = (int(x) for x in p.prompt[:-1].split(p.op))
        assert p.answer == {"+": a + b, "-": a - b, "*": a * b}[p.op]


def test_small_config_and_checks():
    train, held_out = make_splits(ArithTaskConfig(max_operand=2, ops=["+"], held_out_fraction=0.3))
    assert sorted(p.prompt for p in train + held_out) == [f"{a}+{b}=" for a in range(3) for b in range(3)]
    assert len(held_out) == 3  # round(0.3 * 9)
    with pytest.raises(ValueError, match="ops must be non-empty and distinct"):
        ArithTaskConfig(ops=["+", "+"])
    with pytest.raises(ValueError, match="held_out_fraction must be in"):
        ArithTaskConfig(held_out_fraction=1.0)


def test_written_task_loads_through_the_prompt_loader(tmp_path):
    problems = make_splits(ArithTaskConfig(max_operand=5))[1]
    path = tmp_path / "held_out.jsonl"
    write_jsonl(problems, path)
    ds = load_prompts(path, CharTokenizer(), max_prompt_length=16)
    assert [ex.prompt_text for ex in ds] == [p.prompt for p in problems]
    assert [ex.answer for ex in ds] == [p.answer for p in problems]
    assert ds[0].metadata == {"response": problems[0].response}
