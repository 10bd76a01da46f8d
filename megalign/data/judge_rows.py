"""Judge data of the embedded arithmetic task: (problem, candidate response, criterion) -> "Y" / "N".

A tiny model cannot judge from scratch, so the embedded `judge` pipeline (`launch/run_embedded.sh judge`)
fine-tunes its own judge on these rows, as a user would fine-tune a small judge, then uses it as the
only reward of GRPO through RaR's rubric reward (`megalign.rewards.judge.RubricReward`, explicit mode).

Design choices:

- One template (`JUDGE_TEMPLATE`) formats both the SFT rows and the judge's queries: an SFT row's
  `prompt` is `JudgeTemplate(JUDGE_TEMPLATE).render(fields)`, the very call the judge role makes
  (`megalign.roles.judge.Judge`), and the judge runs with `chat_template: false`, so both are BOS +
  the same characters, byte for byte. The SFT `response` is the verdict "Y" or "N" (one character
  token each: the judge's `answers: ["Y", "N"]`), which the SFT loader follows with EOS.
  The template is laid out so that a tiny character-level judge can compare: the criterion first (the
  judge knows what it checks before it reads the response), then the problem and the response exactly as
  the policy saw them, and right after the response the reference answer (`{reference}`, the prompt row's
  gold answer, which the rubric reward supplies; RaR's judges grade against a reference too) in the
  response's own format, ` vs \\boxed{reference}`, so that the verdict follows the compared text and a
  response digit and its reference digit are a fixed distance apart for numbers of one length (13 + the
  number's length characters). Earlier layouts (criterion last, the reference a line below as
  `reference: {prompt}\\boxed{reference}`) taught the format criteria but never the comparison: 40.8% on
  the "Y" rows and 84.4% on the "N" rows of `correct`, at the loss of the base rate even on the judge's
  own training rows (BENCHMARKS.md, "Models in the reward loop"). Measured on `correct` rows alone
  (300 steps) this layout reaches 87.2% / 68.5% where the earlier one reaches 67.8% / 72.4%; trained
  on all three criteria from the start the judge still does not compare (44.4% / 84.0%), while a
  curriculum, the `correct` rows alone at batch 128 first (`judge_train_correct.jsonl`), then all
  three, verifies: 92-96% on `correct` (same section). `run_embedded.sh judge` puts a stage between
  the two, the `correct` rows with the hard negatives below (`judge_train_hard.jsonl`).
- Criteria (`CRITERIA`, the issue's three) and their labels, from the verifier and two format rules:
  `correct` "the final answer equals the correct result" is `math_accuracy` (the last `\\boxed{}`
  against the gold answer: an unboxed right number is "N", as the verifier scores it 0); `boxed`
  "the answer is in \\boxed{}" is whether a balanced `\\boxed{...}` exists (`last_boxed`); `only`
  "the response gives only the final answer" is whether the whole response is one boxed integer.
- Candidates per problem, fixed by (seed, problem) like `wrong_answer`: the right response, a wrong
  one (`wrong_answer`), an unboxed number and a response with extra text around a box (each with the
  right or the wrong answer, by a coin), plus whatever the caller adds: samples of the SFT policy on
  the same problem (`megalign.tools.judge_data`), which are what the judge sees during GRPO.
  Then the hard negatives (`hard_negatives`): wrong boxed answers one edit away from the right one (a digit
  changed, the sign flipped, two digits swapped, a digit turned into a letter or a piece of `boxed` written into
  the number). Without them the judge compared loosely: it accepted 8.9% of the SFT model's wrong answers,
  14-16% of those one leading digit off, and a GRPO policy rewarded by it learned within 100 steps to answer
  `\\boxed{2boxed}`, which that judge accepted 64% of the time (held-out accuracy 21.9% -> 1.9%); trained with
  them (`run_embedded.sh judge`), the judge accepted 3.4% of that policy's wrong answers (BENCHMARKS.md, "Models in the reward loop").
  Duplicate texts of a problem are kept once. Most sampled answers are wrong, so the training rows
  of the `correct` criterion are balanced by repeating the rarer label (`balanced`), and then repeated
  as a whole (`repeated`): the judge learns the two format criteria within a few tens of steps, after
  which their rows carry almost no loss, while the comparison takes hundreds of steps of `correct` rows.
- A reviser for SL-CAI's critique-revise (`reviser_rows`, `run_embedded.sh critique_revise`): a tiny model cannot
  critique or revise untaught, so it is fine-tuned on two rows per (problem, candidate), as a user would fine-tune
  one on wrong -> right rewrites: the critique prompt (`CRITIQUE_TEMPLATE`, the principle being the `correct`
  criterion) -> "right", or "wrong, it is <result>" (the critique computes the result, as the policy must),
  and the revision prompt with that critique (`REVISION_TEMPLATE`) -> the problem's own response `\\boxed{result}`.
- `RUBRIC` is the prompt rows' rubric column for GRPO: the three criteria as RaR items with categories
  (essential 1.0 / important 0.7 / optional 0.3), so the rubric score is
  (c_correct + 0.7 c_boxed + 0.3 c_only) / 2.
"""
from __future__ import annotations

import re
import string
from typing import Sequence

import numpy as np

from megalign.data.arith import _OP_INDEX, ArithProblem, _check_seed, wrong_answer
from megalign.rewards.judge import JudgeTemplate
from megalign.rewards.math import last_boxed, math_accuracy

JUDGE_TEMPLATE = "{criterion}? {prompt}{response} vs \\boxed{{{reference}}}\n"
"""The judge prompt of the embedded task (module doc); the verdict is the next token, "Y" or "N"."""

LABEL_TEMPLATE = JUDGE_TEMPLATE.replace("{criterion}", "{principle}")
"""The same layout as a pointwise judge template of `launch/cai_tools.py label` (`run_embedded.sh rlaif`): the
constitution's principle in the criterion's place, so the judge reads exactly what it was trained on."""

CRITIQUE_TEMPLATE = "{principle}? {prompt}{response}\ncritique:"
REVISION_TEMPLATE = "{prompt}{response}\ncritique:{critique}\nrevision:"
"""SL-CAI's critique and revision prompts on the embedded task (`launch/cai_tools.py critique-revise`, short enough
for the 128 positions of the embedded model); `reviser_rows` trains a reviser on them."""

VERDICTS = ("Y", "N")
"""The two answer tokens (positive first): the judge config's `answers`."""

CRITERIA = {
    "correct": "the final answer equals the correct result",
    "boxed": "the answer is in \\boxed{}",
    "only": "the response gives only the final answer",
}
"""The criteria by key, in the issue's words."""

RUBRIC = [
    {"criterion": CRITERIA["correct"], "category": "essential"},
    {"criterion": CRITERIA["boxed"], "category": "important"},
    {"criterion": CRITERIA["only"], "category": "optional"},
]
"""The rubric column of every GRPO prompt row (module doc)."""

_ONLY = re.compile(r"\\boxed\{-?\d+\}")
_EXTRA = ("{prompt}{box}", "{box} is the answer", "so {box}", "{box}{box}")
_UNBOXED = ("{value}", "answer {value}")
_NON_DIGITS = string.ascii_letters + "%{}\\"
_MARKUP = ("boxed", "oxed", "box", "\\boxed", "{")


def criterion_label(key: str, response: str, answer: int) -> bool:
    """Whether `response` to a problem with gold `answer` meets criterion `key` (module doc)."""
    if key == "correct":
        return math_accuracy(response, answer) == 1.0
    if key == "boxed":
        return last_boxed(response) is not None
    if key == "only":
        return _ONLY.fullmatch(response) is not None
    raise ValueError(f"criterion key {key!r} is not one of {list(CRITERIA)}")


def synthetic_candidates(problem: ArithProblem, seed: int = 0) -> list[str]:
    """The four made-up responses to `problem` (module doc), fixed by (seed, problem)."""
    _check_seed(seed)
    rng = np.random.default_rng([seed, 0x4A44, problem.a, _OP_INDEX[problem.op], problem.b])
    wrong = wrong_answer(problem, seed)
    unboxed_value = problem.answer if rng.random() < 0.5 else wrong
    extra_value = problem.answer if rng.random() < 0.5 else wrong
    unboxed = _UNBOXED[int(rng.integers(len(_UNBOXED)))].format(value=unboxed_value)
    extra = _EXTRA[int(rng.integers(len(_EXTRA)))].format(prompt=problem.prompt, box=f"\\boxed{{{extra_value}}}")
    return [problem.response, f"\\boxed{{{wrong}}}", unboxed, extra]


def hard_negatives(problem: ArithProblem, seed: int = 0) -> list[str]:
    """Wrong boxed answers one edit away from the right one (module doc), fixed by (seed, problem): each digit in
    turn replaced by another digit, the sign flipped, the first two digits swapped, a digit replaced by a non-digit
    character, and a piece of the `boxed` markup written into the number. Duplicates are kept once, in that order,
    and a corruption the verifier scores right is dropped (math-verify reads `0oxed` as the product 0 o x e d = 0)."""
    _check_seed(seed)
    rng = np.random.default_rng([seed, 0x4E4D, problem.a, _OP_INDEX[problem.op], problem.b])
    sign, digits = ("-", str(problem.answer)[1:]) if problem.answer < 0 else ("", str(problem.answer))
    numbers = []
    for i, d in enumerate(digits):
        choices = [c for c in "0123456789" if c != d and not (i == 0 and c == "0" and len(digits) > 1)]
        numbers.append(sign + digits[:i] + str(rng.choice(choices)) + digits[i + 1:])
    if problem.answer != 0:
        numbers.append(("" if sign else "-") + digits)
    if len(digits) > 1 and digits[0] != digits[1]:
        numbers.append(sign + digits[1] + digits[0] + digits[2:])
    at = int(rng.integers(len(digits)))
    numbers.append(sign + digits[:at] + str(rng.choice(list(_NON_DIGITS))) + digits[at + 1:])
    at = int(rng.integers(len(digits) + 1))
    numbers.append(sign + digits[:at] + _MARKUP[int(rng.integers(len(_MARKUP)))] + digits[at:])
    candidates = dict.fromkeys(f"\\boxed{{{n}}}" for n in numbers)
    return [c for c in candidates if math_accuracy(c, problem.answer) == 0.0]


def judge_items(problem: ArithProblem, responses: Sequence[str], source: str) -> list[dict]:
    """One item per (distinct response, criterion): `prompt` (the problem), `response`, `reference` (the gold
    answer as text), `criterion` (its text), `key`, `label` (bool), `answer`, `source` (where the response came
    from, e.g. "synthetic" or "policy")."""
    return [{"prompt": problem.prompt, "response": r, "reference": str(problem.answer), "criterion": CRITERIA[key],
             "key": key, "label": criterion_label(key, r, problem.answer), "answer": problem.answer, "source": source}
            for r in dict.fromkeys(responses) for key in CRITERIA]


def balanced(items: Sequence[dict], key: str) -> list[dict]:
    """`items` with each item of criterion `key` whose label is the rarer one repeated round(n_common / n_rare)
    times (in place, the order otherwise kept): most sampled answers are wrong, and a judge trained on the raw
    mix learns the base rate "N" instead of the comparison (BENCHMARKS.md)."""
    labels = [item["label"] for item in items if item["key"] == key]
    n_yes, n_no = sum(labels), len(labels) - sum(labels)
    if not n_yes or not n_no:
        return list(items)
    rare, times = (True, round(n_no / n_yes)) if n_yes < n_no else (False, round(n_yes / n_no))
    return [copy for item in items
            for copy in [item] * (times if item["key"] == key and item["label"] == rare else 1)]


def repeated(items: Sequence[dict], key: str, times: int) -> list[dict]:
    """`items` with each item of criterion `key` repeated `times` times in place (module doc: the judge's steps
    go to the criterion it learns slowest); ValueError for `times` < 1."""
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    return [copy for item in items for copy in [item] * (times if item["key"] == key else 1)]


def sft_row(item: dict, template: JudgeTemplate) -> dict:
    """The judge's SFT row of one item: `prompt` is `template` filled with the item's fields (as the judge role
    fills it), `response` the verdict; the item's fields are kept as extra columns (the SFT loader ignores them)."""
    return {**item, "prompt": template.render(item), "response": VERDICTS[0] if item["label"] else VERDICTS[1],
            "problem": item["prompt"], "candidate": item["response"]}


def rubric_prompt_rows(problems: Sequence[ArithProblem]) -> list[dict]:
    """GRPO prompt rows with the `rubric` column: `prompt`, `answer`, `rubric` (`RUBRIC`)."""
    return [{"prompt": p.prompt, "answer": p.answer, "rubric": RUBRIC} for p in problems]


def reviser_rows(problem: ArithProblem, responses: Sequence[str]) -> list[dict]:
    """The reviser's SFT rows of `problem` (module doc): per distinct response a critique row and a revision row,
    `prompt` the filled template, `response` the target, plus `problem`, `candidate`, `answer`, `stage`."""
    rows = []
    for r in dict.fromkeys(responses):
        critique = "right" if criterion_label("correct", r, problem.answer) else f"wrong, it is {problem.answer}"
        fields = {"prompt": problem.prompt, "response": r, "principle": CRITERIA["correct"], "critique": critique}
        common = {"problem": problem.prompt, "candidate": r, "answer": problem.answer}
        rows.append({**common, "stage": "critique", "prompt": CRITIQUE_TEMPLATE.format(**fields), "response": critique})
        rows.append({**common, "stage": "revision", "prompt": REVISION_TEMPLATE.format(**fields),
                     "response": problem.response})
    return rows
