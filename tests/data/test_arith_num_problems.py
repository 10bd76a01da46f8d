"""The arithmetic task drawn to a bounded size (`ArithTaskConfig.num_problems`, issue 28's tools example).

References: the hand enumeration of a small task, the products a * b themselves, and the memory of the
full enumeration (a million `ArithProblem`s, ~140 MiB traced) against a few thousand drawn ones.
"""
import os
import tracemalloc

import pytest
import yaml

from megalign.data import ArithTaskConfig, make_splits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_drawn_split_is_bounded_disjoint_and_fixed():
    cfg = ArithTaskConfig(max_operand=999, ops=["*"], num_problems=5000)
    tracemalloc.start()
    try:
        train, held_out = make_splits(cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20  # enumerating all 1,000,000 problems first peaks near 140 MiB
    assert (len(train), len(held_out)) == (4000, 1000)  # round(0.2 * 5000) held out
    prompts = [p.prompt for p in train + held_out]
    assert len(set(prompts)) == 5000  # distinct, so train and held-out are disjoint
    for p in train + held_out:
        a, b = (int(x) for x in p.prompt[:-1].split("*"))
        assert 0 <= a <= 999 and 0 <= b <= 999 and p.op == "*" and p.answer == a * b
    assert make_splits(cfg) == (train, held_out)  # fixed by the seed
    other = make_splits(ArithTaskConfig(max_operand=999, ops=["*"], num_problems=5000, seed=1))[1]
    assert {p.prompt for p in other} != {p.prompt for p in held_out}
    assert max(p.answer for p in held_out) > 100_000  # drawn across the range, not the first indices


def test_drawing_every_problem_is_the_whole_task():
    cfg = ArithTaskConfig(max_operand=3, ops=["+", "-"], num_problems=32, held_out_fraction=0.25)
    train, held_out = make_splits(cfg)
    assert len(held_out) == 8
    expected = sorted(f"{a}{op}{b}=" for op in "+-" for a in range(4) for b in range(4))
    assert sorted(p.prompt for p in train + held_out) == expected
    small_train, small_held_out = make_splits(ArithTaskConfig(max_operand=3, ops=["+", "-"], num_problems=6))
    assert len(small_held_out) == 1 and len(small_train) == 5
    assert {p.prompt for p in small_train + small_held_out} <= set(expected)


@pytest.mark.parametrize("bad", [0, 1, 33, 2.5])
def test_bad_num_problems_names_the_field_and_the_bound(bad):
    with pytest.raises(ValueError, match=r"num_problems must be null or an integer in \[2, 32\]"):
        ArithTaskConfig(max_operand=3, ops=["+", "-"], num_problems=bad)


def test_a_held_out_share_leaving_no_training_problem_is_refused():
    with pytest.raises(ValueError, match="held_out_fraction=0.8 of 2 problems leaves no training problem"):
        ArithTaskConfig(num_problems=2, held_out_fraction=0.8)


def test_the_tools_example_draws_a_bounded_split():
    with open(os.path.join(ROOT, "examples", "grpo_tools_arith.yaml")) as f:
        arith = yaml.safe_load(f)["data"]["arith"]
    train, held_out = make_splits(ArithTaskConfig(**arith))
    assert arith["max_operand"] == 999 and (len(train), len(held_out)) == (4000, 1000)
