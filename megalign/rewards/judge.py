"""Rewards read from a judge model: `judge` (one score a response), `rubric` (Rubrics as Rewards) and a pairwise judge.

Design choices:

- These classes hold no model: they fill a prompt template (`JudgeTemplate`) per response and ask a
  `VerdictSource` (the judge role, `megalign.roles.judge.Judge`, or anything with its `verdicts`) for
  one score per filled template, a probability or a parsed number. So the text side is tested
  without torch, and one judge can serve several rewards in a step, sharing its per-step cache.
- A template names its fields (`{prompt}`, `{response}`, `{criterion}`, `{reference}`, `{rubric}`,
  `{principle}`, `{response_a}`, `{response_b}`). Each reward states what it supplies and checks the
  judge's template when it is built: a field it does not supply (or a misspelt one) fails at
  start-up naming the field and the closest supplied name, never at the first step.
- `RubricReward` follows RaR (Gunjal et al. 2025, arXiv 2507.17746): each prompt row carries rubric
  items `{criterion, weight}` or `{criterion, category}` in a metadata column, the categories
  weighing Essential 1.0, Important 0.7, Optional 0.3, Pitfall 0.9 (a pitfall is phrased positively,
  "the response avoids X", so satisfying it earns its weight). Explicit mode asks the judge about
  every item (c_j in [0, 1]) and scores sum_j w_j c_j / sum_j w_j; implicit mode gives the judge the
  whole rubric (`{rubric}`) for one score. RLVR is the case of one essential item.
- Nothing is dropped silently: a verdict the judge could not parse is scored by the judge's stated
  rule and counted (`reward/<name>/unparsed`), and when the caller passes a verifier's scores the
  reward logs its agreement with them (`reward/<name>/agreement`: the fraction of responses on which
  score >= 1/2 and verifier >= 1/2 agree).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import string
from typing import Any, Mapping, Optional, Protocol, Sequence

FIELDS = ("prompt", "response", "reference", "criterion", "rubric", "principle", "response_a", "response_b")
"""Every field a judge template may name; each reward supplies a subset (`JudgeTemplate.check`)."""

CATEGORY_WEIGHTS = {"essential": 1.0, "important": 0.7, "optional": 0.3, "pitfall": 0.9}
"""RaR's default weight of a rubric item by category (arXiv 2507.17746; pitfalls phrased positively)."""

RUBRIC_CATEGORIES = (*CATEGORY_WEIGHTS, "weighted")
"""The categories a rubric item can have; "weighted": an item given by its weight alone."""


class JudgeTemplate:
    """A judge prompt with named fields, from a config string or a file.

    `spec` holding a `{` is the template itself; otherwise it is the path of a UTF-8 file holding it.
    Literal braces are written doubled (`{{`, `}}`), as in `str.format`.
    """

    def __init__(self, spec: str, key: str = "template"):
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"{key} must be a template string or a file path, got {spec!r}")
        self.key = key
        if "{" in spec:
            self.text = spec
        elif os.path.isfile(spec):
            with open(spec, encoding="utf-8") as fh:
                self.text = fh.read()
        else:
            raise ValueError(f"{key}={spec!r} has no {{field}} and is not a file; give a template string or its path")
        fields = []
        try:
            for _, name, spec_, conversion in string.Formatter().parse(self.text):
                if name is None:
                    continue
                if not name.isidentifier() or spec_ or conversion:
                    raise ValueError(f"{key}: field {{{name}}} must be a plain name like {{response}}")
                fields.append(name)
        except ValueError as exc:
            raise ValueError(f"{key}: not a valid template ({exc}); write literal braces as {{{{ and }}}}") from exc
        self.fields = tuple(dict.fromkeys(fields))
        if not self.fields:
            raise ValueError(f"{key}: the template names no field; it needs at least {{response}}")

    def check(self, supplied: Sequence[str], required: Sequence[str], who: str) -> None:
        """Raise ValueError naming the first field of the template that `who` does not supply (with the closest
        supplied name), or the first of `required` the template leaves out."""
        for name in self.fields:
            if name not in supplied:
                close = difflib.get_close_matches(name, list(supplied), n=1)
                hint = f"; did you mean {{{close[0]}}}?" if close else ""
                raise ValueError(f"{self.key}: field {{{name}}} is not one that {who} supplies "
                                 f"({', '.join(supplied)}){hint}")
        for name in required:
            if name not in self.fields:
                raise ValueError(f"{self.key}: {who} needs the field {{{name}}} in the template")

    def render(self, fields: Mapping[str, str]) -> str:
        return self.text.format(**{name: fields[name] for name in self.fields})

    def key_of(self, fields: Mapping[str, str]) -> tuple:
        """The cache key of this template filled with `fields`: (template text, the values of its fields)."""
        return (self.text, *(fields[name] for name in self.fields))


@dataclasses.dataclass
class Verdicts:
    """What a judge answered for N filled templates: `scores` [N] and `parsed` [N] (False: an unparsable verdict,
    scored by the judge's rule), and how many of the N came from the step's cache."""

    scores: list[float]
    parsed: list[bool]
    cache_hits: int = 0


class VerdictSource(Protocol):
    """A judge: `verdicts(template, rows)` scores `template` filled with each row of fields (one forward or one
    greedy generation per distinct filled template in a step); `template` is its prompt."""

    template: JudgeTemplate

    def verdicts(self, template: JudgeTemplate, rows: Sequence[Mapping[str, str]]) -> Verdicts: ...


class TemplateOnly:
    """A `VerdictSource` with a template and no model: building a reward on it checks the template's fields against
    what the reward supplies (`JudgeTemplate.check`) at config time, before any judge loads; asking it fails."""

    def __init__(self, template: JudgeTemplate):
        self.template = template

    def verdicts(self, template: JudgeTemplate, rows: Sequence[Mapping[str, str]]) -> Verdicts:
        raise RuntimeError(f"{template.key}: a template-only judge checks fields and gives no verdicts")


def _text(value: Any) -> str:
    return "" if value is None else str(value)


class _JudgedReward:
    """What every judge reward shares: its name, its judge, the counters and the agreement with a verifier."""

    def __init__(self, name: str, judge: VerdictSource, supplied: Sequence[str], required: Sequence[str],
                 binary: bool = False):
        if not name or "/" in name or ":" in name:
            raise ValueError(f"judge reward name {name!r} must be non-empty without '/' or ':' (it names metrics)")
        self.name, self.judge, self.binary = name, judge, binary
        judge.template.check(supplied, required, f"the {type(self).__name__} {name!r}")
        self.verdicts = self.unparsed = self.cache_hits = 0
        self.last: dict[str, float] = {}

    def _ask(self, rows: Sequence[Mapping[str, str]]) -> Verdicts:
        """The judge's verdicts on `rows`, counted; with `binary` each score becomes 1 at >= 1/2, else 0."""
        out = self.judge.verdicts(self.judge.template, rows)
        self.verdicts += len(rows)
        self.unparsed += out.parsed.count(False)
        self.cache_hits += out.cache_hits
        if self.binary:
            out = dataclasses.replace(out, scores=[1.0 if s >= 0.5 else 0.0 for s in out.scores])
        return out

    def _record(self, scores: Sequence[float], verifier: Optional[Sequence[float]]) -> None:
        self.last = {f"reward/{self.name}/mean": sum(scores) / len(scores)} if scores else {}
        if verifier is not None:
            if len(verifier) != len(scores):
                raise ValueError(f"{self.name}: verifier has {len(verifier)} scores for {len(scores)} responses")
            if scores:
                agree = sum((s >= 0.5) == (v >= 0.5) for s, v in zip(scores, verifier))
                self.last[f"reward/{self.name}/agreement"] = agree / len(scores)

    def metrics(self) -> dict[str, float]:
        """Cumulative counts (verdicts asked, unparsable ones, cache hits) and the last batch's means."""
        return {f"reward/{self.name}/verdicts": float(self.verdicts),
                f"reward/{self.name}/unparsed": float(self.unparsed),
                f"reward/{self.name}/cache_hits": float(self.cache_hits), **self.last}


def _check_lengths(prompts, responses, answers, metadata) -> Sequence[Mapping[str, Any]]:
    metadata = [{}] * len(responses) if metadata is None else metadata
    lengths = {"prompts": len(prompts), "responses": len(responses), "answers": len(answers), "metadata": len(metadata)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"judge reward inputs must have one length per response, got {lengths}")
    return metadata


class JudgeReward(_JudgedReward):
    """One judge score per response: the template filled with the prompt, the response, the reference answer and
    `criterion` (a fixed string, when given)."""

    def __init__(self, name: str, judge: VerdictSource, criterion: Optional[str] = None, binary: bool = False):
        supplied = ("prompt", "response", "reference") + (("criterion",) if criterion is not None else ())
        super().__init__(name, judge, supplied, ("response",), binary)
        self.criterion = criterion

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any],
                 metadata: Optional[Sequence[Mapping[str, Any]]] = None,
                 verifier: Optional[Sequence[float]] = None) -> list[float]:
        """[N] scores; `verifier` [N]: a verifier's scores of the same responses, for the agreement metric."""
        _check_lengths(prompts, responses, answers, metadata)
        rows = [{"prompt": p, "response": r, "reference": _text(a), "criterion": self.criterion or ""}
                for p, r, a in zip(prompts, responses, answers)]
        scores = self._ask(rows).scores
        self._record(scores, verifier)
        return scores


@dataclasses.dataclass
class RubricItem:
    """One rubric criterion with its weight (and category, when it came from one)."""

    criterion: str
    weight: float
    category: Optional[str] = None


def rubric_items(value: Any, where: str) -> list[RubricItem]:
    """The items of one prompt row's rubric column: a list (or its JSON text) of {criterion, weight} or
    {criterion, category} (category weights `CATEGORY_WEIGHTS`); ValueError naming `where` and the item."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: the rubric is a string but not JSON ({exc})") from exc
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: the rubric must be a non-empty list of {{criterion, weight | category}}, "
                         f"got {value!r}")
    items = []
    for j, item in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("criterion"), str) or not item["criterion"]:
            raise ValueError(f"{at}: a rubric item needs a non-empty string 'criterion', got {item!r}")
        category = item.get("category")
        if category is not None:
            if not isinstance(category, str) or category.lower() not in CATEGORY_WEIGHTS:
                raise ValueError(f"{at}: category {category!r} is not one of {sorted(CATEGORY_WEIGHTS)}")
            category = category.lower()
        weight = item.get("weight", CATEGORY_WEIGHTS[category] if category else None)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"{at}: needs a finite weight > 0 or a category, got weight={weight!r}")
        items.append(RubricItem(item["criterion"], float(weight), category))
    return items


def render_rubric(items: Sequence[RubricItem]) -> str:
    """The whole rubric as the implicit mode's `{rubric}` field: one line per item, its category or weight first."""
    return "\n".join(f"- ({item.category.capitalize() if item.category else f'weight {item.weight:g}'}) "
                     f"{item.criterion}" for item in items)


class RubricReward(_JudgedReward):
    """RaR's rubric reward (module doc): items from the metadata column `column` of each prompt row.

    `mode="explicit"`: one verdict per (response, item), reward sum_j w_j c_j / sum_j w_j; the last batch's
    per-item scores are kept in `item_scores`, each response's mean score per category (`RUBRIC_CATEGORIES`, NaN
    where its rubric has no item of it) in `category_scores`, which the trainers log as the terms
    `<name>_<category>` (`megalign.roles.reward`: `reward/<name>_<category>/mean` over the responses that have
    the category), and their batch means in `metrics()` (`reward/<name>/<category>`).
    `mode="implicit"`: one verdict per response on the whole rubric (`{rubric}`, `render_rubric`).
    """

    def __init__(self, name: str, judge: VerdictSource, column: str = "rubric", mode: str = "explicit",
                 binary: bool = False):
        if mode not in ("explicit", "implicit"):
            raise ValueError(f"rubric mode must be 'explicit' or 'implicit', got {mode!r}")
        field = "criterion" if mode == "explicit" else "rubric"
        super().__init__(name, judge, ("prompt", "response", "reference", field), ("response", field), binary)
        if not column:
            raise ValueError("rubric column must name a field of the prompt rows")
        self.column, self.mode = column, mode
        self.item_scores: list[list[float]] = []
        self.category_scores: dict[str, list[float]] = {}

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any],
                 metadata: Optional[Sequence[Mapping[str, Any]]] = None,
                 verifier: Optional[Sequence[float]] = None) -> list[float]:
        """[N] rubric scores in [0, 1] when the judge's scores are; `verifier` as in `JudgeReward`."""
        metadata = _check_lengths(prompts, responses, answers, metadata)
        rubrics = []
        for i, row in enumerate(metadata):
            if self.column not in row:
                raise ValueError(f"{self.name}: response {i}'s prompt row has no rubric column {self.column!r}")
            rubrics.append(rubric_items(row[self.column], f"{self.name}: response {i}'s {self.column}"))
        base = [{"prompt": p, "response": r, "reference": _text(a)} for p, r, a in zip(prompts, responses, answers)]
        if self.mode == "implicit":
            scores = self._ask([{**b, "rubric": render_rubric(items)} for b, items in zip(base, rubrics)]).scores
            self._record(scores, verifier)
            return scores
        flat = self._ask([{**b, "criterion": item.criterion} for b, items in zip(base, rubrics) for item in items])
        scores, self.item_scores, start = [], [], 0
        self.category_scores = {k: [] for k in RUBRIC_CATEGORIES}
        for items in rubrics:
            c = flat.scores[start:start + len(items)]
            start += len(items)
            self.item_scores.append(c)
            scores.append(sum(item.weight * cj for item, cj in zip(items, c)) / sum(item.weight for item in items))
            for k, values in self.category_scores.items():
                mine = [cj for item, cj in zip(items, c) if (item.category or "weighted") == k]
                values.append(sum(mine) / len(mine) if mine else math.nan)
        self._record(scores, verifier)
        for k, values in self.category_scores.items():
            known = [v for v in values if not math.isnan(v)]
            if known:
                self.last[f"reward/{self.name}/{k}"] = sum(known) / len(known)
        return scores


class PairwiseJudge(_JudgedReward):
    """p(A): the judge's preference for `responses_a` over `responses_b` on each prompt, for online DPO's ranking
    (`rank(...) > 1/2`: A is chosen). With a logprob judge its answers are the two labels ("A", "B")."""

    def __init__(self, name: str, judge: VerdictSource, criterion: Optional[str] = None):
        supplied = ("prompt", "response_a", "response_b") + (("criterion", "principle") if criterion is not None else ())
        super().__init__(name, judge, supplied, ("response_a", "response_b"))
        self.criterion = criterion

    def rank(self, prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str],
             verifier: Optional[Sequence[float]] = None) -> list[float]:
        """[N] p(A better than B); `verifier` [N]: 1 where a verifier prefers A, 0 where B, for the agreement."""
        if not len(prompts) == len(responses_a) == len(responses_b):
            raise ValueError(f"{self.name}: prompts, responses_a and responses_b must have one length, got "
                             f"{len(prompts)}, {len(responses_a)}, {len(responses_b)}")
        c = self.criterion or ""
        rows = [{"prompt": p, "response_a": a, "response_b": b, "criterion": c, "principle": c}
                for p, a, b in zip(prompts, responses_a, responses_b)]
        scores = self._ask(rows).scores
        self._record(scores, verifier)
        return scores
