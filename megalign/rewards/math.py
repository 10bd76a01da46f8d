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
- GSM8K's `#### 72`: a response with neither answer tags nor a box answers with what follows its last
  `####` (to the end of that line), and a gold written that way (GSM8K's solution column) is read the
  same way, so GSM8K rows work as they come.

Two checkers decide whether an extracted answer equals the gold one (`CHECKERS`, chosen per reward term with
`options: {checker: ...}`; `math_accuracy`'s default is `auto`):

- `builtin`: the normalisation and comparison above: exact, predictable, microseconds.
- `math_verify`: HuggingFace's `math-verify` (the checker of TRL, open-r1 and verl; `pip install
  megalign[math]`): both sides parsed into SymPy and compared symbolically, so `\\frac{\\sqrt2}{2}` equals
  `\\sqrt{2}/2`, `\\{1,2\\}` equals `\\{2,1\\}`, `x=2` equals `2`, `0.5` equals `50\\%`, `\\$72` and
  `72\\text{ dollars}` equal `72`. Extraction stays the one above for both checkers (answer tags, the last
  box, `####`): the checker decides equality only, so a switch of checker never changes what counts as
  answering. What `builtin` accepts, this checker accepts too, and where both sides are plain numbers
  (`parse_number`) the builtin comparison alone decides: it is exact, far faster than SymPy, and keeps
  the embedded tasks' rewards (`\\boxed{19}` against 19) unchanged. One guard of ours: against a numeric
  gold, an answer that is unevaluated arithmetic on numbers (`12+7`, `3\\times 4`) does not count,
  although SymPy evaluates it to the gold: on the embedded task the prompt is that expression (`12+7=`),
  and echoing it must not earn the reward. math-verify's own timeouts are SIGALRM timers that fail off
  the main thread and would cancel the per-sample limit of `SafeReward` (the same signal); they are
  turned off (`parsing_timeout=None`, `timeout_seconds=None`) and the reward's `timeout_s` bounds a slow
  parse instead.
- `auto`: `math_verify` when the package is installed, else `builtin`.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import re
from fractions import Fraction
from typing import Any, Callable, Optional

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
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)"
_ARITHMETIC = re.compile(rf"{_NUM}(?:(?:[-+*^×÷]|\\times|\\cdot|\\div){_NUM})+")
"""Unevaluated arithmetic on number literals (normalised, so without spaces): `12+7`, `3\\times4-1`."""

CHECKERS = ("auto", "math_verify", "builtin")
"""Answer checkers (module doc): `auto` is `math_verify` when installed, else `builtin`."""


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
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    return _after_hashes(response) or None


def _after_hashes(text: str) -> Optional[str]:
    """What follows the last `####` of `text` to the end of its line, stripped; None without `####`."""
    at = text.rfind("####")
    return None if at < 0 else text[at + 4:].split("\n", 1)[0].strip()


def gold_text(gold: Any) -> str:
    """The gold answer as text: `str(gold)`, its last `\\boxed{}` unwrapped, or what follows its last `####`
    (a GSM8K solution)."""
    text = str(gold)
    boxed = last_boxed(text)
    if boxed:
        return boxed
    after = _after_hashes(text)
    return text if after is None else after


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
    p, g = normalize_answer(pred), normalize_answer(gold_text(gold))
    if not p:
        return False
    p_num, g_num = parse_number(p), parse_number(g)
    if p_num is not None and g_num is not None:
        return _numbers_match(p_num, g_num)
    return p == g


def _numbers_match(pred: Fraction, gold: Fraction) -> bool:
    return abs(pred - gold) <= NUMERIC_TOL * max(1, abs(gold))


def have_math_verify() -> bool:
    """Whether the `math-verify` package can be imported (the `math` extra)."""
    return importlib.util.find_spec("math_verify") is not None


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's warning that its timeouts are off: `SafeReward`'s per-sample limit replaces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@functools.lru_cache(maxsize=1)
def _math_verify():
    """math-verify's (parse, verify), imported once, with its no-timeout notice filtered."""
    import math_verify
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutNotice())
    return math_verify.parse, math_verify.verify


@functools.lru_cache(maxsize=8192)
def _mv_parse(text: str) -> tuple:
    """math-verify's parse of answer `text` (boxed, so its LaTeX extraction finds it; thin spaces and a trailing
    period dropped, which math-verify misreads: `1\\,000` as 1*0). Cached: a gold is parsed once per group."""
    parse, _ = _math_verify()
    return tuple(parse("\\boxed{" + _SPACING.sub("", text).strip().rstrip(".") + "}", parsing_timeout=None))


def math_verify_match(pred: Optional[str], gold: Any) -> bool:
    """Whether extracted answer `pred` equals `gold` by math-verify, after our own rules (module doc): what
    `answers_match` accepts is accepted, two plain numbers are decided by it alone, and an arithmetic echo
    against a numeric gold is rejected. Needs the `math-verify` package."""
    if answers_match(pred, gold):
        return True
    if pred is None or not normalize_answer(pred):
        return False
    g_text = gold_text(gold)
    p_norm, g_num = normalize_answer(pred), parse_number(normalize_answer(g_text))
    if g_num is not None and (parse_number(p_norm) is not None or _ARITHMETIC.fullmatch(p_norm)):
        return False
    _, verify = _math_verify()
    gold_parsed, pred_parsed = _mv_parse(g_text), _mv_parse(pred)
    return bool(gold_parsed and pred_parsed and verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None))


def answer_checker(checker: str = "auto") -> Callable[[Optional[str], Any], bool]:
    """The comparison `(pred, gold) -> bool` of `checker` (one of `CHECKERS`); a ValueError names a bad one and
    says how to install math-verify when `math_verify` is asked for without it."""
    if checker not in CHECKERS:
        raise ValueError(f"checker {checker!r} is not one of {', '.join(CHECKERS)}")
    if checker == "builtin" or (checker == "auto" and not have_math_verify()):
        return answers_match
    if not have_math_verify():
        raise ValueError("checker 'math_verify' needs the math-verify package: pip install 'megalign[math]' "
                         "(or math-verify); or use checker 'builtin'")
    return math_verify_match


def math_accuracy(response: str, gold: Any, checker: str = "auto") -> float:
    """1.0 when the final answer extracted from `response` matches `gold` by `checker` (module doc), else 0.0."""
    return 1.0 if answer_checker(checker)(extract_answer(response), gold) else 0.0


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
