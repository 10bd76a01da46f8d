"""The two answer checkers of `megalign.rewards.math` side by side: a hand-written table of answer strings
with the verdict each checker must give, the rows where they disagree marked, and the plumbing around
math-verify (the checker switch, no signal timers of its own, the fallback when it is not installed).

The math-verify column is skipped when the package is missing (CI installs it with the test extra)."""
import random
import signal
import threading

import pytest

from megalign.rewards import RewardTerm, build_reward, get_reward
from megalign.rewards import math as rmath
from megalign.rewards.math import answer_checker, answers_match, extract_answer, math_accuracy

# (extracted answer, gold, builtin verdict, math_verify verdict), each worked out by hand from the rules in the
# module doc. DIFFER marks the rows where the checkers disagree.
TABLE = [
    # fractions and decimals: both compare numbers exactly (a plain number on both sides is builtin's call)
    ("1/2", r"\frac{1}{2}", True, True),
    ("0.5", r"\frac{1}{2}", True, True),
    (r"\dfrac{3}{4}", "0.75", True, True),
    (r"-\frac{3}{4}", "-0.75", True, True),
    (r"\frac12", "0.5", False, True),                  # DIFFER: brace-less \frac is LaTeX, not builtin's pattern
    ("0.333", r"\frac{1}{3}", False, False),           # 1e-6 relative tolerance: 0.333 is not 1/3
    ("0.3333333", r"\frac{1}{3}", True, True),
    ("5.0", "5", True, True),
    ("1e3", "1000", True, True),
    # negative numbers and signs
    ("-5", "-5", True, True),
    ("-5", "5", False, False),
    ("+3", "3", True, True),
    # thousands separators
    ("1,000", "1000", True, True),
    (r"1\,000", "1000", True, True),                   # thin space dropped before both
    ("1{,}000", "1000", False, True),                  # DIFFER: LaTeX's {,} separator
    ("1,2", "12", False, False),                       # not a thousands group: a list
    # units and currency
    ("72 dollars", "72", False, False),                # plain words are not units to either
    (r"72\text{ dollars}", "72", False, True),          # DIFFER: math-verify drops \text units
    (r"\$72", "72", False, True),                      # DIFFER: an escaped dollar sign
    (r"\text{72}", "72", True, True),
    # percentages: the sign is dropped (golds write 50 for 50%), so 50% is 50, never 0.5, under both
    (r"50\%", "50", True, True),
    (r"50\%", "0.5", False, False),
    # GSM8K: the gold's `#### 72` is read as 72
    ("72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", True, True),
    ("72.", "72", True, True),
    # sets, intervals, tuples
    (r"\{1,2\}", r"\{2,1\}", False, True),             # DIFFER: sets are unordered
    ("(0,1]", "(0, 1]", True, True),
    ("[0,1)", "(0,1]", False, False),
    # symbolic forms
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}", False, True),  # DIFFER
    ("x^2+2x+1", "(x+1)^2", False, True),              # DIFFER
    ("x=2", "2", False, True),                         # DIFFER: an assignment's value
    ("x", "X", False, True),                           # DIFFER: math-verify is case-insensitive
    (r"2\pi", "6.283185", False, True),                # DIFFER: evaluated to 6 decimals
    # arithmetic echoing the embedded task's prompt never counts against a numeric gold (our guard)
    ("12+7", "19", False, False),
    (r"3\times 4", "12", False, False),
    # nothing extracted, nothing to compare
    (None, "4", False, False),
    ("", "0", False, False),
]


def _ids():
    return [f"{a!r}~{g!r}" for a, g, _, _ in TABLE]


@pytest.mark.parametrize("pred,gold,builtin,_", TABLE, ids=_ids())
def test_builtin_column(pred, gold, builtin, _):
    assert answers_match(pred, gold) is builtin
    assert answer_checker("builtin")(pred, gold) is builtin


@pytest.mark.parametrize("pred,gold,_,verdict", TABLE, ids=_ids())
def test_math_verify_column(pred, gold, _, verdict):
    pytest.importorskip("math_verify")
    assert answer_checker("math_verify")(pred, gold) is verdict


def test_the_table_shows_disagreements_and_math_verify_never_refuses_what_builtin_accepts():
    disagree = [(p, g) for p, g, b, m in TABLE if b != m]
    assert len(disagree) == 10
    assert all(m for _, _, b, m in TABLE if b)


@pytest.mark.parametrize("response,expected", [
    ("So she sold 48 + 24 = 72 clips.\n#### 72", "72"),        # GSM8K's answer line
    ("#### 1,000\nmore text", "1,000"),                        # to the end of its line
    ("first #### 5 then #### 6", "6"),                         # the last wins
    (r"####  7 and \boxed{8}", "8"),                           # a box wins over ####
    ("<answer>9</answer> #### 10", "9"),                       # answer tags win over ####
    ("#### \nno answer on the line", None),
])
def test_gsm8k_answer_line_is_extracted(response, expected):
    assert extract_answer(response) == expected


def test_whole_responses_under_both_checkers():
    pytest.importorskip("math_verify")
    gsm8k_gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    for checker in ("builtin", "math_verify"):
        assert math_accuracy("48 + 24 = 72\n#### 72", gsm8k_gold, checker) == 1.0
        assert math_accuracy("The answer is 72", gsm8k_gold, checker) == 0.0   # no tags, box or ####: no answer
    assert math_accuracy(r"so \boxed{\dfrac{3}{4}}", "0.75", "builtin") == 1.0
    assert math_accuracy(r"so \boxed{\frac34}", "0.75", "builtin") == 0.0
    assert math_accuracy(r"so \boxed{\frac34}", "0.75", "math_verify") == 1.0


def test_embedded_task_rewards_unchanged():
    """Responses of the embedded arithmetic task (`\\boxed{N}`, right, wrong, malformed) score the same under
    both checkers, so its pipelines' numbers do not move with the checker."""
    pytest.importorskip("math_verify")
    rng = random.Random(0)
    forms = [r"\boxed{{{n}}}", r"\boxed{{{n}}}}}", r"\boxed{{{n}", r"\boxed{{-{n}}}", r"\boxed{{{n}0}}", "{n}",
             r"\boxed{{}}", r"\boxed{{{n}+0}}", r"\boxed{{ {n} }}"]
    for _ in range(300):
        gold = rng.randint(-20, 400)
        n = gold if rng.random() < 0.5 else gold + rng.randint(-3, 3)
        response = rng.choice(forms).format(n=n)
        assert math_accuracy(response, gold, "math_verify") == math_accuracy(response, gold, "builtin"), response


def test_checker_switch_in_reward_terms():
    pytest.importorskip("math_verify")
    reward = build_reward([RewardTerm("math_accuracy", label="builtin", options={"checker": "builtin"}),
                           RewardTerm("math_accuracy", label="mv", options={"checker": "math_verify"})])
    out = reward(["q", "q"], [r"\boxed{\$72}", r"\boxed{72}"], ["72", "72"])
    assert list(out) == [1.0, 2.0]    # \$72: only math_verify; 72: both


def test_bad_checker_options_fail_when_the_term_is_built():
    with pytest.raises(ValueError, match="'math_accuracy'.*'sympy' is not one of auto, math_verify, builtin"):
        get_reward("math_accuracy", options={"checker": "sympy"})
    with pytest.raises(ValueError, match="'math_accuracy'.*chekcer"):
        get_reward("math_accuracy", options={"chekcer": "auto"})
    with pytest.raises(ValueError, match="'format' does not take options"):
        get_reward("format", options={"checker": "auto"})


def test_without_math_verify_auto_falls_back_and_math_verify_says_how_to_install(monkeypatch):
    monkeypatch.setattr(rmath, "have_math_verify", lambda: False)
    assert answer_checker("auto") is answers_match
    assert math_accuracy(r"\boxed{\frac34}", "0.75") == 0.0     # the builtin verdict
    with pytest.raises(ValueError, match=r"pip install 'megalign\[math\]'"):
        get_reward("math_accuracy", options={"checker": "math_verify"})


def test_auto_is_math_verify_when_installed():
    pytest.importorskip("math_verify")
    assert answer_checker("auto") is rmath.math_verify_match


def test_math_verify_runs_off_the_main_thread_and_keeps_the_callers_alarm():
    """No signal timer of its own: it works in a worker thread (where SIGALRM cannot be set) and leaves the
    per-sample SIGALRM timer of `SafeReward` running."""
    pytest.importorskip("math_verify")
    results = []
    thread = threading.Thread(target=lambda: results.append(rmath.math_verify_match(r"\sqrt{2}/2", r"\frac{\sqrt2}{2}")))
    thread.start()
    thread.join()
    assert results == [True]
    previous = signal.signal(signal.SIGALRM, lambda *a: None)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        assert rmath.math_verify_match("x^2+2x+1", "(x+1)^2")
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 25.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_safe_reward_timeout_interrupts_a_slow_math_verify(monkeypatch):
    """The reward's own `timeout_s` bounds math-verify (whose own timeouts are off)."""
    pytest.importorskip("math_verify")
    import time

    monkeypatch.setattr(rmath, "_mv_parse", lambda text: time.sleep(5) or ())
    term = get_reward("math_accuracy", timeout_s=0.2, options={"checker": "math_verify"})
    start = time.perf_counter()
    assert list(term(["q"], [r"\boxed{\frac34}"], ["0.75"])) == [0.0]
    assert time.perf_counter() - start < 2.0 and term.errors == 1


def test_user_function_options_are_keyword_arguments(tmp_path):
    path = tmp_path / "scaled.py"
    path.write_text("def scaled(prompt, response, answer, metadata, *, scale=1.0):\n    return len(response) * scale\n")
    term = get_reward(f"{path}:scaled", options={"scale": 0.5})
    assert list(term(["q", "q"], ["abcd", "ab"], [0, 0])) == [2.0, 1.0]
    with pytest.raises(ValueError, match="'.*scaled.py:scaled' does not take options \\['size'\\]"):
        get_reward(f"{path}:scaled", options={"size": 2})
