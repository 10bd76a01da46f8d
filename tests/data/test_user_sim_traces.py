"""The `user_sim` demonstration's traces (`megalign.data.user_sim_traces`) and the table of
`megalign.tools.user_sim_compare` (issue 28).

References: a dialogue written out by hand (messages, the user's scores after each reply from the module doc's
rules: start 50, +5 waiting, -20 premature, +40 solved), sums computed here from the rows' numbers, and episode
counts and tables worked by hand.
"""
import json
import random

import pytest

from megalign.data import CharTokenizer
from megalign.data.tool_traces import episode_ids
from megalign.data.user_sim_traces import (UserSimTracesConfig, assistant_turn, draw_rows, trace_messages,
                                           write_user_sim_traces)
from megalign.envs.user_sim import ArithmeticUser
from megalign.rollout.multiturn import Episode
from megalign.tools.user_sim_compare import comparison_lines, episode_sums, policy_numbers

ROW = {"numbers": [47, 38, 61], "op": "+"}


class Always:
    """A stand-in for the impatience stream: every draw is `value`."""

    def __init__(self, value):
        self.value = value

    def random(self):
        return self.value


def test_assistant_turns_by_hand():
    assert assistant_turn([47, 38, 61], 1, answer=False) == "<think>47</think>Go on."
    assert assistant_turn([47, 38, 61], 2, answer=True) == "<think>47+38=85</think>answer: 85"
    assert assistant_turn([47, 38, 61], 3, answer=True) == "<think>85+61=146</think>answer: 146"


def test_a_patient_trace_and_its_score():
    user = ArithmeticUser()
    messages = trace_messages(ROW, Always(0.9), impatience=0.5, env=user)
    assert messages == [
        {"role": "user", "content": "Add up my numbers; I will tell you one at a time. First: 47."},
        {"role": "assistant", "content": "<think>47</think>Go on."},
        {"role": "user", "content": "Next: 38."},
        {"role": "assistant", "content": "<think>47+38=85</think>Go on."},
        {"role": "user", "content": "Last: 61."},
        {"role": "assistant", "content": "<think>85+61=146</think>answer: 146"}]
    assert user.scores == [50, 55, 60, 100]


def test_an_impatient_trace_and_its_score():
    user = ArithmeticUser()
    messages = trace_messages(ROW, Always(0.1), impatience=0.5, env=user)
    assert [m["content"] for m in messages[1::2]] == ["<think>47</think>answer: 47", "<think>47+38=85</think>answer: 85",
                                                      "<think>85+61=146</think>answer: 146"]
    assert messages[2]["content"] == "Wait, there is more. Next: 38."
    assert user.scores == [50, 30, 10, 50]  # two premature answers, then solved


def test_a_trace_the_user_does_not_accept_is_refused():
    user = ArithmeticUser(premature_penalty=60)  # the first premature answer drops e to 0: the dialogue ends
    with pytest.raises(ValueError, match=r"row \[47, 38, 61\]: the simulated user ended the dialogue"):
        trace_messages(ROW, Always(0.1), impatience=0.5, env=user)


def test_rows_are_distinct_sums_and_held_out_first():
    cfg = UserSimTracesConfig(num_rows=300, held_out=40, min_value=10, max_value=20)
    train, held_out = draw_rows(cfg)
    assert (len(train), len(held_out)) == (260, 40)
    tuples = [tuple(r["numbers"]) for r in train + held_out]
    assert len(set(tuples)) == 300 and all(10 <= n <= 20 for t in tuples for n in t)
    assert all(r["answer"] == sum(r["numbers"]) and r["op"] == "+" for r in train + held_out)
    assert all(r["prompt"].endswith(f"First: {r['numbers'][0]}.") for r in train)


def test_written_files(tmp_path):
    cfg = UserSimTracesConfig(out_dir=str(tmp_path), num_rows=120, held_out=20, impatience=0.5, seed=3)
    counts = write_user_sim_traces(cfg)
    traces = [json.loads(line) for line in open(tmp_path / "user_sim_traces_train.jsonl")]
    train = [json.loads(line) for line in open(tmp_path / "user_sim_train.jsonl")]
    held_out = [json.loads(line) for line in open(tmp_path / "user_sim_held_out.jsonl")]
    assert (len(traces), len(train), len(held_out)) == (100, 100, 20)
    early = [m for t in traces for m in t["messages"][1:-1] if m["role"] == "assistant"]
    premature = sum("answer:" in m["content"] for m in early)
    assert counts["premature_answers"] == premature and 0.35 < premature / len(early) < 0.65  # 200 draws at 0.5
    rng = random.Random(cfg.seed + 1)  # the traces replay from their rows with the same stream
    assert [t["messages"] for t in traces] == [trace_messages(r, rng, 0.5) for r in train]
    assert not {tuple(r["numbers"]) for r in train} & {tuple(r["numbers"]) for r in held_out}
    assert max(len(episode_ids(t["messages"], CharTokenizer())[0]) for t in traces) <= 320  # the SFT max_length


@pytest.mark.parametrize("kwargs, says", [({"count": 1}, "count must be >= 2"), ({"impatience": 1.5}, "impatience"),
                                          ({"num_rows": 10, "held_out": 10}, "held_out must be in"),
                                          ({"min_value": 1, "max_value": 2, "num_rows": 9, "held_out": 1}, "distinct")])
def test_bad_configs_are_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        UserSimTracesConfig(**kwargs)


def test_episode_sums_by_hand():
    solved = Episode(0, 0, action_ranges=[(0, 1)] * 3, reward=1.0, info={"format_ok": 3, "solved": 1})
    impatient = Episode(0, 1, action_ranges=[(0, 1)] * 3, reward=0.5,
                        info={"format_ok": 3, "solved": 1, "premature_answers": 2})
    broken = Episode(1, 0, action_ranges=[(0, 1)], reward=0.0, info={"format_ok": 0, "format_errors": 1})
    failed = Episode(1, 1, action_ranges=[(0, 1)] * 2, reward=0.3, end="error", info={"format_ok": 2})
    sums = episode_sums([solved, impatient, broken, failed])
    assert sums == [1.5, 6.0, 9.0, 2.0, 2.0, 4.0]  # the failed episode scores 0 and no well-formed reply
    numbers = policy_numbers(sums)
    assert numbers == {"score": 0.375, "well_formed": 6 / 9, "solved": 0.5, "premature_per_dialogue": 0.5,
                       "turns_per_dialogue": 2.25, "episodes": 4.0}


def test_comparison_lines_end_with_change_and_ratio():
    def numbers(score):
        return {"score": score, "well_formed": 0.95, "solved": 0.5, "premature_per_dialogue": 1.0}

    results = {"before": {"sampled": numbers(0.30), "greedy": numbers(0.25)},
               "after": {"sampled": numbers(0.66), "greedy": numbers(0.70)}}
    lines = comparison_lines(results, samples=4)
    assert lines[-2:] == ["change  +36.0 points", "ratio  2.20x"]
    assert "T=1 x4" in lines[1] and "score 0.300" in lines[1] and "well-formed  95.0%" in lines[1]
    results["before"]["sampled"] = numbers(0.0)
    assert comparison_lines(results, samples=4)[-1] == "ratio  inf (SFT scores 0)"
