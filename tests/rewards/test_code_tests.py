"""`code_tests`: code extraction by hand-built responses, and the fraction of tests passed, worked out by hand."""
import json

import pytest

from megalign.rewards import RewardTimeout, SafeReward, get_reward
from megalign.rewards.code_tests import CodeTests, extract_code
from megalign.sandbox import unavailable_reason


needs_sandbox = pytest.mark.skipif(unavailable_reason() is not None, reason=f"no sandbox here: {unavailable_reason()}")


@pytest.fixture(scope="module")
def reward():
    fn = CodeTests(timeout_s=2, memory_mb=256, workers=2)
    yield fn
    fn.close()


def test_extract_code_prefers_the_last_python_block():
    response = "First try:\n```python\nprint(1)\n```\nshell:\n```bash\nls\n```\nfixed:\n```py\nprint(2)\n```\nDone."
    assert extract_code(response) == "print(2)\n"


def test_extract_code_falls_back_to_the_last_fence_then_the_whole_text():
    assert extract_code("```\nx = 1\n```\nand\n```text\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f(x):\n    return x") == "def f(x):\n    return x"


@needs_sandbox
def test_stdin_stdout_tests_fraction_passed(reward):
    response = "Here:\n```python\nn = int(input())\nprint(n * n if n < 10 else n)\n```"
    tests = [{"input": "3\n", "output": "9"}, {"input": "4", "output": "16\n\n"},  # trailing blank lines ignored
             {"input": "12", "output": "144"}]  # the code prints 12: fails
    assert reward("", response, None, {"tests": tests}) == pytest.approx(2 / 3)


@needs_sandbox
def test_trailing_spaces_per_line_are_ignored_but_other_whitespace_is_not(reward):
    response = "```python\nprint('a  ')\nprint(' b')\n```"
    assert reward("", response, None, {"tests": [{"input": "", "output": "a\n b"}]}) == 1.0
    assert reward("", response, None, {"tests": [{"input": "", "output": "a\nb"}]}) == 0.0


@needs_sandbox
def test_assert_tests_from_a_json_string(reward):
    response = "```python\ndef add(a, b):\n    return a + b if a >= 0 else a - b\n```"
    tests = json.dumps(["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(-1, 1) == 0",
                        "assert add(10, -4) == 6"])  # add(-1, 1) returns -2: one of four fails
    assert reward("", response, None, {"tests": tests}) == 0.75


@needs_sandbox
def test_a_crash_or_endless_loop_fails_only_its_own_test():
    reward = CodeTests(timeout_s=1, workers=2)
    response = ("```python\nimport sys\ndef f(x):\n    if x == 0:\n        while True:\n            pass\n"
                "    if x < 0:\n        raise ValueError(x)\n    return 2 * x\n```")
    tests = ["assert f(0) == 0", "assert f(-1) == -2", "assert f(3) == 6", "assert f(5) == 10"]
    assert reward("", response, None, {"tests": tests}) == 0.5


@needs_sandbox
def test_a_hostile_response_scores_zero_and_touches_nothing(reward, tmp_path):
    marker = tmp_path / "pwned"
    response = f"```python\nopen({str(marker)!r}, 'w').write('x')\nprint(1)\n```"
    assert reward("", response, None, {"tests": [{"input": "", "output": "1"}]}) == 0.0
    assert not marker.exists()


@needs_sandbox
@pytest.mark.parametrize("exit_early", ["import os\nos._exit(0)", "import sys\nsys.exit(0)",
                                        "import atexit, os\natexit.register(lambda: os._exit(0))"])
def test_a_response_that_exits_before_the_asserts_passes_nothing(reward, exit_early):
    # f is wrong; exiting with status 0 before (or instead of finishing) the asserts used to pass every assert test
    response = f"```python\ndef f(x):\n    return 0\n{exit_early}\n```"
    assert reward("", response, None, {"tests": ["assert f(1) == 2", "assert f(2) == 4"]}) == 0.0
    right = "```python\ndef f(x):\n    return 2 * x\nprint('chatter')\n```"  # its own output is no problem
    assert reward("", right, None, {"tests": ["assert f(1) == 2", "assert f(2) == 4"]}) == 1.0


@needs_sandbox
def test_as_a_user_reward_term_missing_tests_are_counted_failures():
    term = get_reward("megalign.rewards.code_tests:code_tests", timeout_s=20)
    scores = term(["p", "p"], ["```python\nprint(5)\n```", "print(5)"], [None, None],
                  [{"tests": [{"input": "", "output": "5"}]}, {}])
    assert scores == [1.0, 0.0]
    assert term.metrics()["reward/code_tests/errors"] == 1


@pytest.mark.parametrize("tests, says", [(None, "non-empty list"), ([], "non-empty list"),
                                         ([{"input": "1"}], r"tests'\]\[0\]"), ([3], r"tests'\]\[0\]")])
def test_bad_tests_are_named(reward, tests, says):
    with pytest.raises(ValueError, match=says):
        reward("", "print(1)", None, {"tests": tests})


# f(x) = 3x^2 + 2x - 1 on hidden inputs -1, 0, 1, 2 (expected 0, -1, 4, 15), plus one stdin/stdout row.
F_TESTS = {"tests": [f"assert f({x}) == {3 * x * x + 2 * x - 1}" for x in (-1, 0, 1, 2)]}
MIXED = [
    ("```python\ndef f(x):\n    return 3 * x * x + 2 * x - 1\n```", F_TESTS, 1.0),  # right: 4 / 4
    ("```python\ndef f(x):\n    return 3 * x * x + 2 * x - 1 + (x > 0)\n```", F_TESTS, 0.5),  # off by one for x > 0
    ("```python\ndef f(x)\n    return 3 * x * x + 2 * x - 1\n```", F_TESTS, 0.0),  # syntax error: every test fails
    ("```python\ndef f(x):\n    while x == 2:\n        pass\n    return 3 * x * x + 2 * x - 1\n```", F_TESTS,
     0.75),  # endless loop on x = 2: that test runs into its limit, the other three pass
    ("```python\ndef f(x):\n    return x\n```", {}, 0.0),  # no tests: a counted failure, scored 0
    ("```python\nprint(int(input()) * 2)\n```",  # stdin/stdout: 6 right, 10 != 11
     {"tests": [{"input": "3", "output": "6"}, {"input": "5", "output": "11"}]}, 0.5),
]


@needs_sandbox
def test_a_mixed_batch_scores_the_hand_worked_fractions_batched_and_per_sample():
    fn = CodeTests(timeout_s=1, workers=2)
    try:
        term = SafeReward(fn, "code_tests", timeout_s=20)
        responses, metadata, expected = zip(*MIXED)
        assert term([""] * len(MIXED), list(responses), [None] * len(MIXED), list(metadata)) == list(expected)
        assert (term.errors, term.samples) == (1, len(MIXED))
        assert isinstance(term.last_error, ValueError) and "metadata['tests']" in str(term.last_error)
        per_sample = [fn("", r, None, m) for r, m, _ in MIXED if m]
        assert per_sample == [e for _, m, e in MIXED if m]
    finally:
        fn.close()


@needs_sandbox
def test_a_batch_past_its_per_sample_timeout_fails_only_that_sample():
    """Every test of response 1 runs into its 1 s sandbox limit; with 2 workers its 4 tests need 2 s, past the
    term's 1.5 s per sample: it fails (counted) and the responses before and after it keep their scores."""
    fn = CodeTests(timeout_s=1, workers=2)
    try:
        term = SafeReward(fn, "code_tests", timeout_s=1.5)
        responses = [MIXED[0][0], "```python\nwhile True:\n    pass\n```", MIXED[1][0]]
        assert term([""] * 3, responses, [None] * 3, [F_TESTS] * 3) == [1.0, 0.0, 0.5]
        assert term.errors == 1 and isinstance(term.last_error, RewardTimeout)
    finally:
        fn.close()
