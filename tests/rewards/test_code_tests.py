"""`code_tests`: code extraction by hand-built responses, and the fraction of tests passed, worked out by hand."""
import json

import pytest

from megalign.rewards import get_reward
from megalign.rewards.code_tests import extract_code, make_code_tests
from megalign.sandbox import unavailable_reason


needs_sandbox = pytest.mark.skipif(unavailable_reason() is not None, reason=f"no sandbox here: {unavailable_reason()}")


@pytest.fixture(scope="module")
def reward():
    return make_code_tests(timeout_s=2, memory_mb=256, workers=2)


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
    reward = make_code_tests(timeout_s=1, workers=2)
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
