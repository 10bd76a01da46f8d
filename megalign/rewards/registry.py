"""Rewards by name, so a YAML config can list terms and weights:

```yaml
rewards:
  - {name: math_accuracy, weight: 1.0}                      # checker auto: math-verify when installed
  - {name: math_accuracy, weight: 1.0, options: {checker: builtin}}   # or pin a checker
  - {name: format, weight: 0.2}
  - {name: my_project.rewards:length_penalty, weight: 0.1}   # a user function
```

A name with a colon is a user function spec (`megalign.rewards.user.load_function`); any other name
must be registered. A registered reward with options is a class whose constructor takes them (checked when the
term is built, before any training) and whose instances score samples; a user function takes its options as
keyword arguments. Every term is wrapped in `SafeReward`, so no term can stop training or hang it
(a per-sample timeout).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, Mapping, Optional, Sequence, Union

from megalign.config import option
from megalign.rewards.base import DEFAULT_TIMEOUT_S, CombinedReward, SafeReward, SampleReward
from megalign.rewards.math import answer_checker, extract_answer, format_reward
from megalign.rewards.user import load_function

REWARDS: dict[str, Union[SampleReward, type]] = {}
"""Registered per-sample rewards `fn(prompt, response, answer, metadata) -> float` by name, or classes whose
instances (built with a term's `options`) are such rewards."""


def register_reward(name: str, fn: Union[SampleReward, type]) -> Union[SampleReward, type]:
    """Add `fn` under `name`; names are unique and contain no colon (kept for user specs)."""
    if ":" in name or not name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain no ':'")
    if name in REWARDS:
        raise ValueError(f"a reward named {name!r} is already registered")
    REWARDS[name] = fn
    return fn


class MathAccuracy:
    """`math_accuracy` as a reward term: 1.0 when the answer extracted from the response equals the gold one by
    `checker` (auto | math_verify | builtin, `megalign.rewards.math`), else 0.0; a bad checker fails here."""

    def __init__(self, checker: str = "auto"):
        self.checker = checker
        self.match = answer_checker(checker)

    def __call__(self, prompt: str, response: str, answer: Any, metadata: Mapping[str, Any]) -> float:
        return 1.0 if self.match(extract_answer(response), answer) else 0.0


def _format(prompt: str, response: str, answer: Any, metadata: Mapping[str, Any]) -> float:
    return format_reward(response)


register_reward("math_accuracy", MathAccuracy)
register_reward("format", _format)


def reward_label(name: str) -> str:
    """A term's name in metrics: a registered name as is, a user spec's function name (`a/b.py:fn` -> `fn`),
    so metric names never embed file paths or module paths."""
    return name.rpartition(":")[2] if ":" in name else name


def _with_options(fn: Union[SampleReward, type], options: Mapping[str, Any], name: str) -> SampleReward:
    """`fn` ready to score: a registered class built with `options`, or a function with `options` bound as keyword
    arguments (checked against its signature now, so a bad option fails before training)."""
    if isinstance(fn, type):
        try:
            return fn(**options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"reward {name!r}: bad options {dict(options)}: {exc}") from exc
    if not options:
        return fn
    try:
        inspect.signature(fn).bind(None, None, None, None, **options)
    except TypeError as exc:
        raise ValueError(f"reward {name!r} does not take options {sorted(options)}: {exc}") from exc
    return functools.partial(fn, **options)


def get_reward(name: str, label: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
               options: Optional[Mapping[str, Any]] = None) -> SafeReward:
    """The registered reward `name`, or the user function spec `name`, with `options` (a registered class's
    constructor arguments, a function's keyword arguments), wrapped in `SafeReward` named `label` (default
    `reward_label(name)`) with a per-sample limit of `timeout_s` seconds (0: none)."""
    label = label or reward_label(name)
    if ":" in name:
        return SafeReward(_with_options(load_function(name), options or {}, name), label, timeout_s)
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered: {', '.join(sorted(REWARDS))}, or a 'module:function' spec")
    return SafeReward(_with_options(REWARDS[name], options or {}, name), label, timeout_s)


@dataclasses.dataclass
class RewardTerm:
    """One weighted term of the total reward."""

    name: str = option(doc="a registered reward (math_accuracy, format) or a user function 'module:function' / 'file.py:function'")
    weight: float = option(1.0, doc="multiplies this term in the total reward")
    label: Optional[str] = option(None, doc="name of the term in metrics (reward/<label>/...); null: the registered name, or a user function's name without its module or file")
    options: dict[str, Any] = option({}, doc="options of the reward: math_accuracy takes checker (auto: math-verify when "
                                             "installed, else builtin | math_verify | builtin); a user function takes "
                                             "them as keyword arguments")

    def __post_init__(self):
        if not self.name:
            raise ValueError("reward name must not be empty")
        if self.label is not None and (not self.label or "/" in self.label or ":" in self.label):
            raise ValueError(f"reward label {self.label!r} must be non-empty without '/' or ':' (it names metrics)")
        if not math.isfinite(self.weight):
            raise ValueError(f"weight of reward {self.name!r} must be finite, got {self.weight}")


def build_reward(terms: Sequence[RewardTerm], timeout_s: float = DEFAULT_TIMEOUT_S) -> CombinedReward:
    """The weighted sum of `terms`, each resolved with `get_reward` (errors name the bad term) and limited to
    `timeout_s` seconds per sample."""
    return CombinedReward([(get_reward(t.name, t.label, timeout_s, t.options), t.weight) for t in terms])
