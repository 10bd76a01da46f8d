"""`SafeReward` over a staged reward (`StagedReward`): every sample is started before any is awaited, and the
per-sample rules (a raise, a non-number or a run past `timeout_s` scores 0 and is counted) hold in both stages."""
import time

import pytest

from megalign.rewards import RewardTimeout, SafeReward


class Recorder:
    """A staged reward that logs its calls: `start` on response r logs ("start", r) and `finish` ("finish", r).

    Responses: "ok" -> 1.0; "half" -> 0.5; "bad_start" raises in start; "bad_finish" raises in finish; "nan"
    returns NaN; "slow_start" / "slow_finish" sleep `slow` s in that stage before returning 1.0."""

    def __init__(self, slow: float = 0.0):
        self.log = []
        self.slow = slow

    def start(self, prompt, response, answer, metadata):
        self.log.append(("start", response))
        if response == "bad_start":
            raise KeyError("no tests")
        if response == "slow_start":
            time.sleep(self.slow)

        def finish():
            self.log.append(("finish", response))
            if response == "bad_finish":
                raise RuntimeError("sandbox gone")
            if response == "slow_finish":
                time.sleep(self.slow)
            return {"ok": 1.0, "half": 0.5, "nan": float("nan")}.get(response, 1.0)

        return finish

    def __call__(self, prompt, response, answer, metadata):
        return self.start(prompt, response, answer, metadata)()


def score(term, responses):
    n = len(responses)
    return term(["p"] * n, responses, [None] * n)


def test_every_sample_starts_before_any_is_awaited_and_failures_are_counted():
    fn = Recorder()
    term = SafeReward(fn, "staged", timeout_s=0)
    assert score(term, ["ok", "bad_start", "half", "bad_finish", "nan"]) == [1.0, 0.0, 0.5, 0.0, 0.0]
    assert fn.log == [("start", r) for r in ("ok", "bad_start", "half", "bad_finish", "nan")] + [
        ("finish", r) for r in ("ok", "half", "bad_finish", "nan")]
    assert (term.errors, term.samples) == (3, 5)
    assert isinstance(term.last_error, ValueError) and "non-finite" in str(term.last_error)


def test_the_same_scores_as_the_per_sample_path():
    staged = score(SafeReward(Recorder(), "staged"), ["half", "bad_finish", "ok"])
    per_sample = score(SafeReward(lambda p, r, a, m: Recorder()(p, r, a, m), "plain"), ["half", "bad_finish", "ok"])
    assert staged == per_sample == [0.5, 0.0, 1.0]


@pytest.mark.parametrize("responses, expected, errors", [
    (["slow_finish", "ok"], [0.0, 1.0], 1),  # the wait alone runs past the 0.5 s limit (slow 0.7 s)
    (["slow_start", "ok"], [0.0, 1.0], 1),  # the start alone runs past it
])
def test_a_stage_past_the_timeout_fails_only_its_sample(responses, expected, errors):
    term = SafeReward(Recorder(slow=0.7), "staged", timeout_s=0.5)
    assert score(term, responses) == expected
    assert term.errors == errors and isinstance(term.last_error, RewardTimeout)


def test_the_start_and_the_wait_share_one_sample_limit():
    """start sleeps 0.3 s and finish 0.3 s: each is under the 0.5 s limit, together they are past it."""

    class Both(Recorder):
        def start(self, prompt, response, answer, metadata):
            time.sleep(0.3)
            return super().start(prompt, "slow_finish", answer, metadata)

    term = SafeReward(Both(slow=0.3), "staged", timeout_s=0.5)
    assert score(term, ["x"]) == [0.0]
    assert term.errors == 1 and isinstance(term.last_error, RewardTimeout)
    assert score(SafeReward(Both(slow=0.05), "staged", timeout_s=1.0), ["x"]) == [1.0]
