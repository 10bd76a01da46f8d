"""Rewards for RL: rule-based verifiers (math answers, format), user functions, weighted combinations.

`build_reward([RewardTerm("math_accuracy", 1.0), RewardTerm("format", 0.2)])` gives a batched
`CombinedReward`; `.score(prompts, responses, answers, metadata)` returns the total and per-term
rewards, `.metrics()` the per-term error counters. A term whose work runs elsewhere (`code_tests` in the sandbox
pool) is a `StagedReward`, started for the whole batch before any result is awaited.
"""
from megalign.rewards.base import (DEFAULT_TIMEOUT_S, CombinedReward, RewardBreakdown, RewardFunction, RewardTimeout,
                                   SafeReward, SampleReward, StagedReward)
from megalign.rewards.math import (
    FORMAT_PATTERN,
    answers_match,
    extract_answer,
    format_reward,
    math_accuracy,
    normalize_answer,
    parse_number,
)
from megalign.rewards.registry import REWARDS, RewardTerm, build_reward, get_reward, register_reward
from megalign.rewards.user import RewardSpecError, load_function

__all__ = [
    "DEFAULT_TIMEOUT_S", "CombinedReward", "RewardBreakdown", "RewardFunction", "RewardTimeout", "SafeReward",
    "SampleReward", "StagedReward",
    "FORMAT_PATTERN", "answers_match", "extract_answer", "format_reward", "math_accuracy",
    "normalize_answer", "parse_number",
    "REWARDS", "RewardTerm", "build_reward", "get_reward", "register_reward",
    "RewardSpecError", "load_function",
]
