"""The reward-function interface, the per-sample safety wrapper and weighted combinations.

Design choices:

- A `RewardFunction` is batched: `(prompts, responses, answers, metadata) -> list[float]`, one
  float per response (G responses of a prompt appear as G rows with the same prompt and answer).
  Batching lets a reward model score many responses at once; rule-based verifiers and user
  functions are written per sample (`SampleReward`) and lifted to a batch by `SafeReward`.
- `SafeReward` is where "a reward function never stops training" is kept: a sample whose function
  raises, or returns something that is not a finite real number, gets reward 0 and is counted
  (`metrics()`, for the trainer's log); the first failure is logged once with its traceback, the
  later ones only counted, so a broken function cannot flood the log.
- A sample that runs longer than `timeout_s` is a failure too (`RewardTimeout`, counted like a raise),
  so a verifier that never returns (an endless loop, a network call that hangs) cannot hang the job:
  the trainer's `reward.max_failure_fraction` then stops the run. The limit is a SIGALRM timer
  (`signal.setitimer`), which interrupts the function itself between bytecodes or in a blocking call
  and leaves no thread running behind, as math_verify's and verl's verifier timeouts do; signals reach
  only the main thread, so a timed `SafeReward` refuses to run elsewhere. C code that holds the GIL
  (a catastrophic regex) is not interrupted: the trainers' step watchdog is the backstop.
- A per-sample reward whose work runs elsewhere (a sandbox pool, a server) may also be staged
  (`StagedReward`: `fn.start(prompt, response, answer, metadata)` returns a zero-argument callable that
  gives the float). `SafeReward` then starts every sample of the batch before it waits on any, so the
  work of the whole batch is in flight at once, then collects the results in order. The semantics are
  the per-sample ones: a sample's start and its wait share its `timeout_s` (the wait gets what its start
  left), and a failure in either scores 0 and is counted.
- `CombinedReward` is a weighted sum of named terms and returns the per-term values beside the
  total (`RewardBreakdown`), so the trainer logs accuracy and format separately without keeping
  state between calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import threading
import time
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
"""Seconds one sample may take in a reward function by default: verifiers take milliseconds; a term that
calls a judge over the network needs its config's `reward.timeout_s` raised."""

SampleReward = Callable[[str, str, Any, Mapping[str, Any]], float]
"""A per-sample reward: `fn(prompt, response, answer, metadata) -> float`."""


class StagedReward(Protocol):
    """A per-sample reward (`SampleReward`) whose work can be started for a whole batch before any result is
    awaited: `start(...)` submits the sample's work and returns `finish`, and `finish()` waits for it and returns
    the float. `SafeReward` starts every sample, then finishes them in order (module doc)."""

    def __call__(self, prompt: str, response: str, answer: Any, metadata: Mapping[str, Any]) -> float: ...

    def start(self, prompt: str, response: str, answer: Any, metadata: Mapping[str, Any]) -> Callable[[], float]: ...


class RewardFunction(Protocol):
    """A batched reward: one float per response; all sequences have the same length N."""

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[Any],
        metadata: Optional[Sequence[Mapping[str, Any]]] = None,
    ) -> Sequence[float]: ...


def _check_batch(prompts, responses, answers, metadata) -> Sequence[Mapping[str, Any]]:
    """`metadata` (empty dicts when None) after checking that all four sequences have one length."""
    n = len(responses)
    if metadata is None:
        metadata = [{}] * n
    lengths = {"prompts": len(prompts), "responses": n, "answers": len(answers), "metadata": len(metadata)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"reward inputs must have one length per response, got {lengths}")
    return metadata


class RewardTimeout(BaseException):
    """A sample ran past `SafeReward.timeout_s`. A BaseException, as KeyboardInterrupt is, so that a user function's
    own `except Exception:` (a retry loop) does not swallow it and go on hanging."""


@contextlib.contextmanager
def _time_limit(seconds: float, name: str, limit: float):
    """Raise `RewardTimeout` in the body when it runs past `seconds` (what is left of the sample's `limit`; at once
    when nothing is left) (SIGALRM; the previous handler and timer are put back, so an enclosing user of SIGALRM
    keeps working)."""
    def expire(signum=None, frame=None):
        raise RewardTimeout(f"reward {name!r} ran past its timeout of {limit:g} s on a sample (reward.timeout_s)")

    if seconds <= 0:
        expire()

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, outer)


_FAILED = object()
"""What `SafeReward._attempt` returns for a failed call (a sample that then scores 0)."""


def _finite(value: Any) -> float:
    """`value` as a finite float; a reward that returns anything else is failing."""
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"returned {value!r}, not a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned a non-finite reward {value}")
    return value


class SafeReward:
    """Batched `RewardFunction` over a per-sample function `fn`, isolating each sample's failure; a staged `fn`
    (`StagedReward`) has the whole batch started before any sample is awaited.

    `name` keys the metrics: `reward/<name>/errors` (failed samples so far, timed-out ones included) and
    `reward/<name>/samples` (samples scored so far), both cumulative over the wrapper's life. `timeout_s`:
    seconds one sample may take (module doc); 0: no limit.
    """

    def __init__(self, fn: SampleReward, name: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not (math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"timeout of reward {name!r} must be a finite number of seconds >= 0, got {timeout_s}")
        self.fn = fn
        self.name = name
        self.timeout_s = timeout_s
        self.errors = 0
        self.samples = 0
        self.last_error: Optional[BaseException] = None
        """The latest exception a sample raised (the trainer re-raises it when too many samples fail)."""

    def _attempt(self, call: Callable[[], Any], seconds: float) -> Any:
        """`call()` within `seconds` (when this reward has a timeout); a failure is counted, logged the first time,
        and returned as `_FAILED`."""
        try:
            if self.timeout_s:
                with _time_limit(seconds, self.name, self.timeout_s):
                    return call()
            return call()
        except (Exception, RewardTimeout) as exc:
            self.errors += 1
            self.last_error = exc
            if self.errors == 1:
                logger.warning(
                    "reward %r failed on a sample; it scores 0 and is counted in reward/%s/errors "
                    "(later failures are counted, not logged)",
                    self.name,
                    self.name,
                    exc_info=True,
                )
            return _FAILED

    def _score(self, call: Callable[[], Any], seconds: float) -> float:
        """The finite float `call()` returns within `seconds`, else 0.0 (a counted failure)."""
        value = self._attempt(lambda: _finite(call()), seconds)
        return 0.0 if value is _FAILED else value

    def _staged(self, prompts, responses, answers, metadata) -> list[float]:
        """Start every sample (`StagedReward.start`), then finish each with what its start left of `timeout_s`."""
        pending = []
        for p, r, a, m in zip(prompts, responses, answers, metadata):
            began = time.monotonic()
            finish = self._attempt(lambda: self.fn.start(p, r, a, m), self.timeout_s)
            pending.append((finish, time.monotonic() - began))
        return [0.0 if finish is _FAILED else self._score(finish, self.timeout_s - spent) for finish, spent in pending]

    def __call__(self, prompts, responses, answers, metadata=None) -> list[float]:
        metadata = _check_batch(prompts, responses, answers, metadata)
        if self.timeout_s and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"reward {self.name!r} has a timeout, which needs the main thread (SIGALRM reaches only "
                               f"it); call it from the main thread or set its timeout to 0")
        self.samples += len(responses)
        if hasattr(self.fn, "start"):
            return self._staged(prompts, responses, answers, metadata)
        return [self._score(lambda: self.fn(p, r, a, m), self.timeout_s)
                for p, r, a, m in zip(prompts, responses, answers, metadata)]

    def metrics(self) -> dict[str, float]:
        return {f"reward/{self.name}/errors": float(self.errors), f"reward/{self.name}/samples": float(self.samples)}


@dataclasses.dataclass
class RewardBreakdown:
    """`total[i] = sum_k weight_k * terms[name_k][i]`; every list has one float per response."""

    total: list[float]
    terms: dict[str, list[float]]

    def metrics(self) -> dict[str, float]:
        """Batch means `reward/mean` and `reward/<name>/mean` (0 for an empty batch)."""
        out = {"reward/mean": _mean(self.total)}
        out.update({f"reward/{name}/mean": _mean(values) for name, values in self.terms.items()})
        return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class CombinedReward:
    """Weighted sum of reward functions: `CombinedReward([(fn, weight), ...])`.

    A term is named by its `name` attribute (as `SafeReward` has), else its `__name__`; names must
    be distinct because they key the breakdown and metrics.
    """

    def __init__(self, terms: Sequence[tuple[RewardFunction, float]]):
        if not terms:
            raise ValueError("CombinedReward needs at least one (function, weight) term")
        self.terms: list[tuple[str, RewardFunction, float]] = []
        for i, (fn, weight) in enumerate(terms):
            name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or f"term{i}"
            if any(name == other for other, _, _ in self.terms):
                raise ValueError(f"CombinedReward: two terms are named {name!r}; names key the metrics "
                                 f"(give one a distinct `label` in the reward config)")
            if not math.isfinite(float(weight)):
                raise ValueError(f"CombinedReward: weight of {name!r} must be finite, got {weight}")
            self.terms.append((name, fn, float(weight)))

    def score(self, prompts, responses, answers, metadata=None) -> RewardBreakdown:
        metadata = _check_batch(prompts, responses, answers, metadata)
        total = [0.0] * len(responses)
        values: dict[str, list[float]] = {}
        for name, fn, weight in self.terms:
            out = [float(v) for v in fn(prompts, responses, answers, metadata)]
            if len(out) != len(responses):
                raise ValueError(f"reward {name!r} returned {len(out)} values for {len(responses)} responses")
            values[name] = out
            total = [t + weight * v for t, v in zip(total, out)]
        return RewardBreakdown(total=total, terms=values)

    def __call__(self, prompts, responses, answers, metadata=None) -> list[float]:
        return self.score(prompts, responses, answers, metadata).total

    def metrics(self) -> dict[str, float]:
        """The error counters of the terms that keep them (`SafeReward.metrics`)."""
        out: dict[str, float] = {}
        for _, fn, _ in self.terms:
            if hasattr(fn, "metrics"):
                out.update(fn.metrics())
        return out
