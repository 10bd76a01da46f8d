"""Verifiable math rewards: extract the final answer from a response and compare it with the gold one.

Design choices (the usual R1-zero / MATH-grader conventions, written down so users can predict them):

- Extraction (`extract_answer`): the LAST complete `<answer>...</answer>` wins (models often restate
  an answer; the last one is the final word); inside it, a `\\boxed{...}` is unwrapped. Without
  answer tags, the LAST balanced `\\boxed{...}` (nested braces allowed) wins. An unclosed tag or
  unbalanced box is not an answer. Nothing found -> None -> reward 0.
- Normalisation (`normalize_answer`) removes what only changes the typesetting: whitespace, `$`,
  `\\left`/`\\right`, thin spaces, `\\text{..}`-style wrappers, `\\dfrac`/`\\tfrac`, a trailing
  period, a trailing percent sign (so `50\\%` matches `50`), a leading `+`, and thousands commas
  (`1,000` but not `1,2`, which may be a list).
- Comparison (`answers_match`): when both sides parse as numbers (integers, decimals, scientific
  notation, `a/b`, `\\frac{a}{b}`, with a sign) they are compared as exact fractions with a tolerance
  of `NUMERIC_TOL * max(1, |gold|)` (so `0.5 == \\frac{1}{2}` and `5.0 == 5`, but `0.333 != 1/3`);
  otherwise the normalised strings must be equal (case-sensitive: `x` and `X` may differ in math).
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Optional

NUMERIC_TOL = 1e-6
"""Numbers match when |pred - gold| <= NUMERIC_TOL * max(1, |gold|)."""

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\left|\\right|\\[!,;: ]|\\quad|\\qquad")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_DECIMAL = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_SLASH = re.compile(r"(-?\d+)/(\d+)")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last balanced `\\boxed{...}` (or `\\fbox{...}`) in `text`, nested braces kept."""
    for match in reversed(list(_BOX_OPEN.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(response: str) -> Optional[str]:
    """The final answer in `response` (see the module doc for the rules), or None."""
    tags = _ANSWER_TAG.findall(response)
    if tags:
        boxed = last_boxed(tags[-1])
        return boxed if boxed is not None else tags[-1]
    return last_boxed(response)


def normalize_answer(answer: str) -> str:
    """`answer` without typesetting noise, e.g. `" $\\text{1,000}$. "` -> `"1000"`."""
    s = _SPACING.sub("", answer)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _WRAPPERS.sub(r"\1", s)
    s = "".join(s.replace("$", "").split())
    s = s.rstrip(".")
    s = s.removesuffix("\\%").removesuffix("%")
    s = s.removeprefix("+")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def parse_number(normalized: str) -> Optional[Fraction]:
    """The exact value of a normalised numeric answer (`-3`, `2.50`, `1e3`, `3/4`, `-\\frac{1}{2}`), or None."""
    try:
        if _DECIMAL.fullmatch(normalized):
            return Fraction(normalized)
        slash = _SLASH.fullmatch(normalized)
        if slash:
            return Fraction(int(slash[1]), int(slash[2]))
        frac = _FRAC.fullmatch(normalized)
        if frac:
            value = Fraction(int(frac[2]), int(frac[3]))
            return -value if frac[1] else value
    except ZeroDivisionError:
        return None
    return None


def answers_match(pred: Optional[str], gold: Any) -> bool:
    """Whether extracted answer `pred` equals `gold` (str, int or float; a boxed gold is unwrapped)."""
    if pred is None:
        return False
    gold_text = str(gold)
    gold_text = last_boxed(gold_text) or gold_text
    p, g = normalize_answer(pred), normalize_answer(gold_text)
    if not p:
        return False
    p_num, g_num = parse_number(p), parse_number(g)
    if p_num is not None and g_num is not None:
        return abs(p_num - g_num) <= NUMERIC_TOL * max(1, abs(g_num))
    return p == g


def math_accuracy(response: str, gold: Any) -> float:
    """1.0 when the final answer extracted from `response` matches `gold`, else 0.0."""
    return 1.0 if answers_match(extract_answer(response), gold) else 0.0


FORMAT_PATTERN = re.compile(
    r"\s*<think>(?P<think>(?:(?!</?think>).)*)</think>\s*<answer>(?P<answer>(?:(?!</?answer>).)*)</answer>\s*",
    re.DOTALL,
)
"""The whole response (fullmatch) must be: optional whitespace, `<think>` ... `</think>`, optional
whitespace, `<answer>` ... `</answer>`, optional whitespace. The think part may be empty but holds no
other think tag; the answer part holds no other answer tag and must not be blank (checked in code)."""


def format_reward(response: str) -> float:
    """1.0 when `response` follows `<think>...</think><answer>...</answer>` exactly (FORMAT_PATTERN), else 0.0."""
    match = FORMAT_PATTERN.fullmatch(response)
    return 1.0 if match is not None and match["answer"].strip() else 0.0
