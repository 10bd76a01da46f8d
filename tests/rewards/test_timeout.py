"""A reward function that never returns: the per-sample timeout scores it 0, counts it as a failure and moves on."""
import signal
import threading
import time

import pytest

from megalign.rewards import RewardTerm, RewardTimeout, SafeReward, build_reward

PROMPTS, ANSWERS = ["p"] * 3, [0] * 3


def hangs_on_b(prompt, response, answer, metadata):
    """1.0, except on response "b", where it hangs swallowing every Exception (a naive retry loop)."""
    while response == "b":
        try:
            time.sleep(3600)
        except Exception:
            pass
    return 1.0


def spins_on_b(prompt, response, answer, metadata):
    """1.0, except on response "b", where it spins in pure Python forever."""
    while response == "b":
        pass
    return 1.0


@pytest.mark.parametrize("fn", [hangs_on_b, spins_on_b])
def test_a_sample_past_the_timeout_scores_zero_and_counts_as_a_failure(fn):
    reward = SafeReward(fn, "slow", timeout_s=0.2)
    start = time.monotonic()
    assert reward(PROMPTS, ["a", "b", "c"], ANSWERS) == [1.0, 0.0, 1.0]
    assert time.monotonic() - start < 30
    assert (reward.errors, reward.samples) == (1, 3)
    assert isinstance(reward.last_error, RewardTimeout) and "reward.timeout_s" in str(reward.last_error)
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_timeout_reaches_every_term_of_a_config_and_is_checked():
    reward = build_reward([RewardTerm("format"), RewardTerm("math_accuracy")], timeout_s=0.5)
    assert [fn.timeout_s for _, fn, _ in reward.terms] == [0.5, 0.5]
    with pytest.raises(ValueError, match="timeout of reward 'x' must be a finite number of seconds >= 0"):
        SafeReward(hangs_on_b, "x", timeout_s=-1)


def test_an_outer_alarm_survives_a_timed_reward():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        SafeReward(hangs_on_b, "slow", timeout_s=0.05)(PROMPTS, ["a", "b", "c"], ANSWERS)
        time.sleep(1.0)
        assert fired == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_timed_reward_refuses_another_thread_rather_than_run_unlimited():
    errors = []

    def call():
        try:
            SafeReward(hangs_on_b, "slow", timeout_s=1)(PROMPTS, ["a", "c", "a"], ANSWERS)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "needs the main thread" in errors[0]
    assert SafeReward(hangs_on_b, "untimed", timeout_s=0)(PROMPTS, ["a", "c", "a"], ANSWERS) == [1.0] * 3
