"""The judge role: a frozen causal LM that answers judge prompts, and the configs of the rewards built on it.

Design choices:

- A judge is any causal-LM HF folder with its own tokenizer and chat template (`build_tokenizer` on
  its folder), on its own tp layout and dtype with an offloadable "weights" part, like the reference
  and the reward models (`megalign.roles.base`); pp is 1 (a judge is small next to the policy).
  The filled template is rendered as one user message with the judge's chat template
  (`chat_template: false`: the raw text after BOS), and the answer is read at the first generated
  position.
- Two verdict modes. `logprob`: ONE forward of the templated prompts, no sampling: the logits of the
  two answer tokens at the last prompt position (each answer word must be one token of the judge's
  tokenizer, checked at start-up) give score = p(a_1) / (p(a_1) + p(a_2)) = sigmoid(l_1 - l_2), the
  rest of the vocabulary cancelling out. Prompts run sorted by length in micro-batches of
  `micro_batch_size` (less padding), and at tp > 1 only the last position's vocab-sharded logits are
  gathered (`LMHead.gather_logits`), [b, V] per micro-batch. `generate`: greedy decoding on
  megalign's rollout engine (`megalign.rollout.rollout`, the actor's hybrid engine) up to
  `max_new_tokens`, then `pattern` (a regex with one group) searched in the decoded text gives the
  score; a verdict it cannot parse (no match, or a group that is not a finite number) scores
  `unparsed_score` and is counted (`Verdicts.parsed`), never silently.
- A per-step cache maps (template, filled fields) to the verdict, so a criterion repeated in a step
  (G identical samples of a prompt, one rubric item shared by several rewards) is computed once;
  the trainer clears it with `new_step()` and the rewards count its hits.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal, Mapping, Optional, Sequence

import torch

from megalign.config import option
from megalign.data.tokenizer import Tokenizer, TokenizerConfig, build_tokenizer, check_vocab
from megalign.models import CausalLM, from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rewards.judge import JudgeReward, JudgeTemplate, RubricReward, Verdicts
from megalign.roles.base import DTYPES, ModelRole, ModelRoleConfig
from megalign.rollout import EngineConfig, SamplingParams, rollout


@dataclasses.dataclass
class JudgeConfig(ModelRoleConfig):
    """A judge model (`path`: any causal-LM HF folder with its tokenizer) and how its verdicts are read."""

    template: str = option("", doc="(required) the judge prompt with named fields ({prompt}, {response}, {criterion}, {reference}, "
                               "{rubric}, {principle}, {response_a}, {response_b}), or the path of a file holding it")
    mode: Literal["logprob", "generate"] = option(
        "logprob", doc="logprob: p(answers[0]) / (p(answers[0]) + p(answers[1])) at the first generated position, one "
                       "forward; generate: greedy generation, then `pattern`'s group as the score")
    answers: list[str] = option(["yes", "no"], doc="logprob: the two answer words (positive first), each one token")
    max_new_tokens: int = option(16, doc="generate: tokens generated per verdict at most")
    pattern: str = option(r"(-?\d+(?:\.\d+)?)", doc="generate: regex searched in the verdict; its one group is the score")
    unparsed_score: float = option(0.0, doc="generate: the score of a verdict `pattern` cannot parse (counted as unparsed)")
    micro_batch_size: int = option(16, doc="judge prompts per forward (logprob) or decoded together (generate)")
    chat_template: bool = option(True, doc="render the filled template as a user message with the judge's chat "
                                           "template; false: the raw text after BOS")

    def __post_init__(self):
        super().__post_init__()
        if not self.path:
            raise ValueError("judge path (an HF causal-LM folder) is required")
        if self.pp != 1:
            raise ValueError(f"judge pp must be 1 (a judge runs whole on its tp group), got {self.pp}")
        if self.mode not in ("logprob", "generate"):
            raise ValueError(f"judge mode must be 'logprob' or 'generate', got {self.mode!r}")
        JudgeTemplate(self.template, "judge.template")
        if len(self.answers) != 2 or len(set(self.answers)) != 2 or not all(self.answers):
            raise ValueError(f"judge answers must be two distinct non-empty words (positive first), got {self.answers}")
        if self.max_new_tokens < 1 or self.micro_batch_size < 1:
            raise ValueError(f"max_new_tokens and micro_batch_size must be >= 1, got {self.max_new_tokens} and "
                             f"{self.micro_batch_size}")
        try:
            groups = re.compile(self.pattern).groups
        except re.error as exc:
            raise ValueError(f"judge pattern {self.pattern!r} is not a regex: {exc}") from exc
        if groups != 1:
            raise ValueError(f"judge pattern {self.pattern!r} must have exactly one group (the score), has {groups}")
        if not math.isfinite(self.unparsed_score):
            raise ValueError(f"judge unparsed_score must be finite, got {self.unparsed_score}")


@dataclasses.dataclass
class JudgeRewardConfig:
    """One reward term read from a judge (`megalign.rewards.judge`): a single score or RaR's rubric score."""

    name: str = option(doc="the term's name (metrics reward/<name>/...) and its judge role's")
    judge: JudgeConfig = option(doc="the judge model, its template and verdict mode")
    weight: float = option(1.0, doc="multiplies the term in the total reward")
    kind: Literal["judge", "rubric"] = option("judge", doc="judge: one score a response; rubric: RaR over the rubric "
                                                           "items of the prompt rows' `rubric_column`")
    criterion: Optional[str] = option(None, doc="judge: the {criterion} every response is judged on; null: none")
    rubric_column: str = option("rubric", doc="rubric: the prompt rows' field holding the items")
    rubric_mode: Literal["explicit", "implicit"] = option(
        "explicit", doc="rubric: explicit = one verdict per item, sum w c / sum w; implicit = one verdict on the rubric")
    binary: bool = option(False, doc="score each verdict 1 when >= 1/2, else 0 (RaR's 0/1 item verdicts); false: the "
                                     "probability. GRPO normalises each group by its std, so with probabilities a group "
                                     "of wrong answers gets full-size advantages from the judge's doubt alone")

    def __post_init__(self):
        if self.kind not in ("judge", "rubric"):
            raise ValueError(f"judge reward kind must be 'judge' or 'rubric', got {self.kind!r}")
        if not math.isfinite(self.weight):
            raise ValueError(f"weight of judge reward {self.name!r} must be finite, got {self.weight}")


def answer_token(tokenizer: Tokenizer, word: str, key: str) -> int:
    """The one token id of `word` in the judge's tokenizer; ValueError naming the word and its ids otherwise."""
    ids = tokenizer.encode(word)
    if len(ids) != 1:
        raise ValueError(f"{key}: answer {word!r} is {len(ids)} tokens {ids} of the judge's tokenizer "
                         f"({tokenizer.name}); a logprob judge reads one token per answer")
    return ids[0]


class Judge(ModelRole):
    """A frozen judge model as a role; `verdicts(template, rows)` scores each filled template (module doc)."""

    def __init__(self, name: str, cfg: JudgeConfig, model: CausalLM, tokenizer: Tokenizer, layout: ParallelLayout,
                 key: str = "judge"):
        super().__init__(name, model, layout, cfg.offload_weights)
        model.requires_grad_(False).eval()
        check_vocab(tokenizer, model.config.vocab_size, f"{key}.path {cfg.path!r}")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.template = JudgeTemplate(cfg.template, f"{key}.template")
        self.pattern = re.compile(cfg.pattern)
        self.answer_ids = [answer_token(tokenizer, w, f"{key}.answers") for w in cfg.answers] \
            if cfg.mode == "logprob" else []
        if cfg.chat_template:
            tokenizer.apply_chat_template([{"role": "user", "content": "x"}])  # fails now when it has no template
        self.cache: dict[tuple, tuple[float, bool]] = {}

    def new_step(self) -> None:
        """Forget the cached verdicts (a new step's policy writes new responses)."""
        self.cache.clear()

    def encode(self, text: str) -> list[int]:
        """The judge's prompt ids for one filled template (module doc)."""
        if self.cfg.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, add_bos=True)

    def verdicts(self, template: JudgeTemplate, rows: Sequence[Mapping[str, str]]) -> Verdicts:
        """Scores [N] of `template` filled with each of the N `rows`, reading every distinct one not cached this step.

        Collective over the judge's tp group: every tp rank passes the same rows.
        """
        keys = [template.key_of(row) for row in rows]
        todo = list(dict.fromkeys(k for k in keys if k not in self.cache))
        hits = len(keys) - len(todo)
        first = {k: i for i, k in reversed(list(enumerate(keys)))}
        if todo:
            ids = [self.encode(template.render(rows[first[k]])) for k in todo]
            limit = self.model.config.max_position_embeddings - (self.cfg.max_new_tokens if self.cfg.mode == "generate" else 0)
            for k, seq in zip(todo, ids):
                if len(seq) > limit:
                    raise ValueError(f"{self.name}: a judge prompt of {len(seq)} tokens (row {first[k]}) does not fit "
                                     f"the judge's {self.model.config.max_position_embeddings} positions "
                                     f"(generate mode keeps max_new_tokens={self.cfg.max_new_tokens} of them)")
            read = self._logprob(ids) if self.cfg.mode == "logprob" else self._generate(ids)
            self.cache.update(zip(todo, read))
        out = [self.cache[k] for k in keys]
        return Verdicts([s for s, _ in out], [p for _, p in out], hits)

    def _batches(self, ids: list[list[int]]):
        """(indices, left-padded input ids [b, P], mask [b, P]) per micro-batch, rows sorted by length."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        device = self.layout.device
        for start in range(0, len(order), self.cfg.micro_batch_size):
            chunk = order[start:start + self.cfg.micro_batch_size]
            width = max(len(ids[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), self.tokenizer.pad_id, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                input_ids[row, width - len(ids[i]):] = torch.tensor(ids[i])
                mask[row, width - len(ids[i]):] = 1
            yield chunk, input_ids.to(device), mask.to(device)

    @torch.no_grad()
    def _logprob(self, ids: list[list[int]]) -> list[tuple[float, bool]]:
        """p(answer 1) / (p(answer 1) + p(answer 2)) at the first generated position of each prompt."""
        out: list[tuple[float, bool]] = [(0.0, True)] * len(ids)
        for chunk, input_ids, mask in self._batches(ids):
            hidden = self.model.model(input_ids, mask)[:, -1]  # [b, H] the last prompt token (left padding)
            logits = self.model.lm_head.gather_logits(self.model.lm_head(hidden))[:, self.answer_ids].float()
            for i, p in zip(chunk, torch.softmax(logits, -1)[:, 0].tolist()):
                out[i] = (p, True)
        return out

    @torch.no_grad()
    def _generate(self, ids: list[list[int]]) -> list[tuple[float, bool]]:
        """Greedy verdicts on the rollout engine, parsed by `pattern` (module doc)."""
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=0.0,
                                eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id)
        engine = EngineConfig(max_batch=self.cfg.micro_batch_size, prefill_batch=self.cfg.micro_batch_size)
        out: list[tuple[float, bool]] = [(0.0, True)] * len(ids)
        for chunk, input_ids, mask in self._batches(ids):
            generated, _ = rollout(self.model, input_ids, mask, 1, params, 0, engine)
            width = input_ids.shape[1]
            tokens, real = generated.sequences[:, width:].cpu(), generated.attention_mask[:, width:].bool().cpu()
            for i, row, keep in zip(chunk, tokens, real):
                out[i] = self.parse(self.tokenizer.decode(row[keep].tolist()))
        return out

    def parse(self, text: str) -> tuple[float, bool]:
        """(score, parsed) of a generated verdict: `pattern`'s group as a finite float, else (unparsed_score, False)."""
        match = self.pattern.search(text)
        if match is not None:
            try:
                value = float(match.group(1))
            except (TypeError, ValueError):
                value = math.nan
            if math.isfinite(value):
                return value, True
        return self.cfg.unparsed_score, False


def load_judge(name: str, cfg: JudgeConfig, layout: ParallelLayout, key: str = "judge") -> Judge:
    """The judge role `name` of config `key` on `layout` (its tp group), with its own tokenizer (`build_tokenizer` on
    its folder)."""
    tokenizer = build_tokenizer(TokenizerConfig(kind="auto"), cfg.path)
    model = from_pretrained(cfg.path, layout=layout, dtype=DTYPES[cfg.dtype])
    return Judge(name, cfg, model, tokenizer, layout, key)


def judge_reward(cfg: JudgeRewardConfig, judge: Judge):
    """The reward term `cfg` describes on `judge` (its template checked against the fields the term supplies)."""
    if cfg.kind == "judge":
        return JudgeReward(cfg.name, judge, cfg.criterion, cfg.binary)
    return RubricReward(cfg.name, judge, cfg.rubric_column, cfg.rubric_mode, cfg.binary)

