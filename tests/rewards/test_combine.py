"""Weighted combinations, user functions from specs, the per-sample safety wrapper and the registry."""
import logging
import re

import pytest

from megalign.rewards import CombinedReward, RewardSpecError, RewardTerm, SafeReward, build_reward, get_reward, load_function

PROMPTS = ["1+1=", "2*3=", "9-4="]
ANSWERS = [2, 6, 5]


def test_weighted_combination_matches_hand_computed_values():
    responses = [
        "<think>one plus one</think><answer>2</answer>",  # accuracy 1, format 1
        "<answer>6</answer>",  # accuracy 1, format 0
        "<think>x</think><answer>4</answer>",  # accuracy 0, format 1
    ]
    reward = build_reward([RewardTerm("math_accuracy", 1.0), RewardTerm("format", 0.25)])
    out = reward.score(PROMPTS, responses, ANSWERS)
    assert out.terms == {"math_accuracy": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0]}
    assert out.total == [1.25, 1.0, 0.25]
    assert out.metrics() == {"reward/mean": 2.5 / 3, "reward/math_accuracy/mean": 2 / 3, "reward/format/mean": 2 / 3}
    assert reward(PROMPTS, responses, ANSWERS) == [1.25, 1.0, 0.25]


def test_combined_reward_checks_its_terms_and_lengths():
    def short(prompts, responses, answers, metadata):
        return [1.0]

    with pytest.raises(ValueError, match="at least one"):
        CombinedReward([])
    with pytest.raises(ValueError, match="two terms are named 'format'"):
        build_reward([RewardTerm("format"), RewardTerm("format", 2.0)])
    with pytest.raises(ValueError, match="reward 'short' returned 1 values for 3 responses"):
        CombinedReward([(short, 1.0)])(PROMPTS, ["a", "b", "c"], ANSWERS)
    with pytest.raises(ValueError, match="one length per response"):
        CombinedReward([(short, 1.0)])(PROMPTS, ["a"], ANSWERS)
    with pytest.raises(ValueError, match="unknown reward 'acuracy'; registered: format, math_accuracy"):
        get_reward("acuracy")
    with pytest.raises(ValueError, match="weight of reward 'format' must be finite"):
        RewardTerm("format", float("nan"))


USER_MODULE = """
def length(prompt, response, answer, metadata):
    return len(response) * metadata.get("scale", 1.0)

NOT_CALLABLE = 3

def too_few(prompt, response):
    return 0.0
"""


def test_user_function_by_module_and_by_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = get_reward("my_user_rewards:length")
    file_spec = f"{tmp_path / 'my_user_rewards.py'}:length"
    by_file = get_reward(file_spec)
    meta = [{"scale": 2.0}, {}, {}]
    assert by_module(PROMPTS, ["ab", "abc", ""], ANSWERS, meta) == [4.0, 3.0, 0.0]
    assert by_file(PROMPTS, ["ab", "abc", ""], ANSWERS, meta) == [4.0, 3.0, 0.0]
    # both terms are named by the function, never by a path: the second needs its own label
    with pytest.raises(ValueError, match="two terms are named 'length'.*label"):
        build_reward([RewardTerm("my_user_rewards:length", 0.5), RewardTerm(file_spec, -1.0)])
    combined = build_reward([RewardTerm("my_user_rewards:length", 0.5), RewardTerm(file_spec, -1.0, "length_file")])
    assert combined(PROMPTS, ["ab", "abc", ""], ANSWERS, meta) == [-2.0, -1.5, 0.0]
    assert set(combined.metrics()) == {f"reward/{n}/{c}" for n in ("length", "length_file") for c in ("errors", "samples")}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon", "must look like 'module:function'"),
        ("megalign_no_such_module:f", r"cannot import 'megalign_no_such_module': ModuleNotFoundError"),
        ("my_user_rewards:missing", "has no attribute 'missing'"),
        ("my_user_rewards:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
        ("my_user_rewards:too_few", "must accept 4 positional arguments"),
        ("{tmp}/nope.py:f", "file '.*nope.py' does not exist"),
        ("{tmp}/broken.py:f", r"cannot import '.*broken.py': ZeroDivisionError"),
    ],
)
def test_bad_user_function_specs_name_the_spec(tmp_path, monkeypatch, spec, message):
    (tmp_path / "my_user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(RewardSpecError, match=re.escape(f"reward function '{spec}'") + ".*" + message):
        load_function(spec)


def test_failing_samples_score_zero_are_counted_and_logged_once(caplog):
    def flaky(prompt, response, answer, metadata):
        if response == "boom":
            raise RuntimeError("verifier crashed")
        if response == "nan":
            return float("nan")
        if response == "text":
            return "1.0"
        return 1.0

    reward = SafeReward(flaky, "flaky")
    with caplog.at_level(logging.WARNING, logger="megalign.rewards.base"):
        first = reward(["p"] * 4, ["ok", "boom", "nan", "text"], [0] * 4)
        second = reward(["p"] * 2, ["boom", "ok"], [0] * 2)
    assert first == [1.0, 0.0, 0.0, 0.0]
    assert second == [0.0, 1.0]
    assert reward.metrics() == {"reward/flaky/errors": 4.0, "reward/flaky/samples": 6.0}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "reward 'flaky' failed" in warnings[0].getMessage()
    assert "RuntimeError: verifier crashed" in caplog.text  # the traceback is in the one warning
    combined = CombinedReward([(reward, 2.0)])
    assert combined(["p"], ["boom"], [0]) == [0.0]
    assert combined.metrics() == {"reward/flaky/errors": 5.0, "reward/flaky/samples": 7.0}
