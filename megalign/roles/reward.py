"""The reward: rule-based verifiers and user functions (`megalign.rewards`), plus reward-model roles.

Verifiers and user functions run on the host on decoded text, each sample isolated by `SafeReward`
(a raising function, or one running past `reward.timeout_s`, scores 0 and is counted). Reward models are roles of their own (one per entry of
`reward.models`, plus the single `reward.model` of older configs, named "reward_model"), each on its
own layout (tp x pp) and dtype with its own offload switch and weight, and each logged as its own term
(`reward/<name>/mean`). At pp > 1 a reward model is this rank's pipeline stage and scores by the
forward-only schedule in `REWARD_MICROBATCHES_PER_STAGE` x pp micro-batches (`Pipeline.score_broadcast`:
any batch size; the scores reach every rank of its pp group, which holds one batch):

- `kind: outcome`: an HF sequence-classification checkpoint loaded as `RewardModel`
  (`models.from_pretrained(kind="reward")`); it reads the last real token of prompt + response and its
  linear score enters the total with its weight. By default it reads the actor's token ids, so its checkpoint must
  have been saved with the actor's tokenizer (`megalign.trainers.model_checks.check_tokenizer`). With
  `tokenizer: own` it reads its own tokenizer (from its folder) and the reward re-tokenises the text for it, as
  TRL and OpenRLHF do for an RM of another family (`OutcomeReward.encode_texts`): the actor's decoded prompt (with
  the actor's chat template when prompts are templated) and response become [user, assistant] in the RM's chat
  template when it has one, else the string-pair ids of megalign's RM data, `encode(prompt, add_bos=True) +
  encode(response) + [eos]`; rows are right-padded, and one longer than the RM's positions is an error.
- `kind: process`: a process reward model exported by `megalign.trainers.prm` (a causal LM with
  `prm.json` beside it: the reward tokens and the step separator). It scores every step of a response
  with p(correct) at the token where the step ends (`megalign.algos.reward_shaping.step_ends`), which
  gives per-token rewards [N, R] (`Reward.step_rewards`) rather than a term of the sequence total; an
  algorithm that trains on them (PPO) adds them to its token rewards, so GAE credits each step.
- `reward.gated`: Llama 2's gate over two outcome models (`megalign.algos.reward_shaping.gated_reward`):
  their scores then enter the total only through the gated term LOGIT(R_c) ("gated", with the gate's
  weight; "gated_safety_branch" logs the fraction of responses that took the safety branch). The
  whitening of that term over the global batch is the algorithm's (PPO's `shape_rewards`).
- `reward.ensemble`: the mean or minimum of several outcome models' scores, each standardised with its own
  `reward_stats.json` (`megalign.algos.reward_shaping.ensemble_reward`, Coste et al. 2024), as one term `<name>`
  (and `<name>_spread`, the members' disagreement); the members enter the total only through it
  (`megalign.roles.reward_combine`).

- `reward.judges`: judge and rubric terms (`megalign.rewards.judge`), each read from its own judge role
  (`megalign.roles.judge`: a causal LM with its own tokenizer, tp, dtype and offload switch) that the
  trainer builds (`load_judge`) and places like a reward model; a term's score enters the total with its
  weight, and when verifier / user-function terms are configured their total (or the `reward.check_with` term
  alone, which may have weight 0) is the verifier its agreement is measured against (`<name>_agreement`: 1 where
  judge >= 1/2 and verifier >= 1/2 agree).

- `reward.check_with`: a verifier term (weight 0 to monitor only) that every outcome model's ranking is checked
  against each step on the current policy's samples (`reward/<name>/pairwise_acc` over the same-prompt pairs the
  verifier separates, `megalign.rewards.ranking`): an RM's held-out accuracy as the policy moves, where reward
  hacking shows (the RM's score rises while this falls); judges' agreement is measured against it too.

Only the reward models and judges hold device memory ("weights" of each role, offloadable).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping, Optional, Sequence

import torch

from megalign.algos.reward_shaping import (STEP_SCORES, ensemble_reward, gated_reward, place_step_scores, prm_inputs,
                                          step_ends)
from megalign.config import option
from megalign.data import CharTokenizer, Tokenizer
from megalign.models import CausalLM
from megalign.parallel import ParallelLayout, Pipeline
from megalign.parallel.collectives import all_reduce
from megalign.rewards import DEFAULT_TIMEOUT_S, RewardTerm, build_reward
from megalign.rewards.registry import reward_label
from megalign.rewards.judge import JudgeTemplate, RubricReward, TemplateOnly
from megalign.roles.base import ModelRoleConfig, Role, module_slots
from megalign.roles.judge import Judge, JudgeRewardConfig, judge_reward
from megalign.roles.reward_combine import (GATED_TERMS, EnsembleRewardConfig, GatedRewardConfig, check_combined,
                                          combined_members)
from megalign.roles.reward_exports import reward_stats

RESERVED_NAMES = ("actor", "critic", "reference", "reward", *GATED_TERMS)
"""Role and term names a reward model's `name` may not take."""
REWARD_MICROBATCHES_PER_STAGE = 2
"""Micro-batches per pipeline stage when a reward model at pp > 1 scores (the rollout engine's default too):
the forward-only schedule's bubble is (pp - 1) / (m + pp - 1) of its time, a third at pp = 2."""


@dataclasses.dataclass
class RewardModelConfig(ModelRoleConfig):
    """One reward-model role: an outcome RM (a score per response) or a process RM (a score per step)."""

    name: str = option("reward_model", doc="its role and term name (metrics reward/<name>/mean; reward.gated refers to it)")
    kind: Literal["outcome", "process"] = option(
        "outcome", doc="outcome: an HF sequence-classification RM (its linear score, at the last token); process: a "
                       "launch/train_prm.py export (prm.json beside it), p(correct) at the end of every step")
    weight: float = option(1.0, doc="multiplies its score (outcome) or each step's reward (process)")
    step_score: Literal["prob", "centered"] = option(
        "prob", doc=f"process: a step's reward from its p(correct): one of {STEP_SCORES} (p, or p - 1/2)")
    tokenizer: Literal["actor", "own"] = option(
        "actor", doc="actor: it reads the actor's token ids (its folder's tokenizer, if any, must be the actor's); "
                     "own: outcome only, it reads its own folder's tokenizer and the text is re-tokenised for it")

    def __post_init__(self):
        super().__post_init__()
        if not self.path:
            raise ValueError(f"path (an HF checkpoint folder) is required for reward model {self.name!r}")
        if not self.name or "/" in self.name or ":" in self.name or "[" in self.name:
            raise ValueError(f"name {self.name!r} must be non-empty without '/', ':' or '[' (it names a role and metrics)")
        if self.name in RESERVED_NAMES:
            raise ValueError(f"name {self.name!r} is reserved; not one of {list(RESERVED_NAMES)}")
        if not math.isfinite(self.weight):
            raise ValueError(f"weight of reward model {self.name!r} must be finite, got {self.weight}")
        if self.tokenizer == "own" and self.kind == "process":
            raise ValueError(f"tokenizer='own' of reward model {self.name!r}: a process reward model scores each actor "
                             f"token where a step ends, so it must read the actor's ids (tokenizer='actor')")


@dataclasses.dataclass
class RewardConfig:
    """The total reward: a weighted sum of verifier / user-function terms and reward models, [gated]."""

    terms: list[RewardTerm] = option([RewardTerm("math_accuracy", 1.0)],
                                     doc="verifier or user-function terms ('module:function' or 'file.py:function')")
    model: Optional[ModelRoleConfig] = option(
        None, doc="one outcome reward model named 'reward_model' (HF sequence-classification checkpoint); "
                  "the same as an entry of `models`")
    model_weight: float = option(1.0, doc="weight of `model`'s score in the total")
    models: list[RewardModelConfig] = option([], doc="reward-model roles, each with its name, path, tp, dtype, offload, "
                                                     "weight and kind (outcome or process)")
    gated: Optional[GatedRewardConfig] = option(None, doc="Llama 2's gate over two outcome models of `models`; null: off")
    ensemble: Optional[EnsembleRewardConfig] = option(
        None, doc="the mean or minimum of outcome models' standardised scores as one term (module doc); null: off")
    judges: list[JudgeRewardConfig] = option([], doc="judge / rubric terms, each read from its own judge role (name, "
                                                     "weight, kind judge | rubric, judge: {path, tp, template, mode...})")
    check_with: Optional[str] = option(
        None, doc="label of a verifier term of `terms` every outcome reward model's ranking is checked against each "
                  "step on the current policy's samples: reward/<model>/pairwise_acc, the fraction of same-prompt "
                  "pairs the term separates that the model orders the same way, and judges' agreement "
                  "(<judge>_agreement) is measured against (give the term weight 0 to monitor without rewarding); "
                  "null: off")
    max_failure_fraction: float = option(
        0.5, doc="stop the run when a term fails (raises, non-number, times out) on more than this fraction of a "
                 "step's samples")
    timeout_s: float = option(
        DEFAULT_TIMEOUT_S, doc="seconds one sample may take in a verifier or user-function term; a sample past it "
                               "scores 0 and counts as a failure (max_failure_fraction); 0: no limit")

    def empty(self) -> bool:
        """No term, reward model or judge: allowed only where something else rewards (the online trainers check
        it: multi-turn episodes whose environment is the whole reward)."""
        return not self.terms and not self.reward_models() and not self.judges

    def __post_init__(self):
        if self.model is not None and self.model.path is None:
            raise ValueError("reward.model.path is required for a reward-model role")
        if not math.isfinite(self.model_weight):
            raise ValueError(f"model_weight must be finite, got {self.model_weight}")
        names = [m.name for _, m in self.reward_models()] + [j.name for j in self.judges]
        if len(set(names)) != len(names):
            raise ValueError(f"reward model and judge names must be unique (reward.model is named 'reward_model'), "
                             f"got {names}")
        for i, j in enumerate(self.judges):
            if j.name in RESERVED_NAMES:
                raise ValueError(f"reward.judges[{i}].name {j.name!r} is reserved; not one of {list(RESERVED_NAMES)}")
            # the template against the fields its term supplies, now: a misspelt field fails before any model loads
            judge_reward(j, TemplateOnly(JudgeTemplate(j.judge.template, f"reward.judges[{i}].judge.template")))
        check_combined(self.gated, self.ensemble, {m.name: m.kind for _, m in self.reward_models()})
        if self.check_with is not None:
            labels = [t.label or reward_label(t.name) for t in self.terms]
            if self.check_with not in labels:
                raise ValueError(f"reward.check_with={self.check_with!r} names no term of reward.terms; their labels: "
                                 f"{labels} (add the verifier with weight 0 to monitor without rewarding)")
            if not [m for _, m in self.reward_models() if m.kind == "outcome"] and not self.judges:
                raise ValueError("reward.check_with checks outcome reward models' rankings and judges' agreement, but "
                                 "reward.model / reward.models / reward.judges hold none")
        if not 0 <= self.max_failure_fraction <= 1:
            raise ValueError(f"max_failure_fraction must be in [0, 1], got {self.max_failure_fraction}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s >= 0):
            raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got {self.timeout_s}")

    def reward_models(self) -> list[tuple[str, RewardModelConfig]]:
        """(config key, config) of every reward model: `model` (as 'reward_model') first, then `models`."""
        out = []
        if self.model is not None:
            fields = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(ModelRoleConfig)}
            out.append(("reward.model", RewardModelConfig(**fields, name="reward_model", weight=self.model_weight)))
        return out + [(f"reward.models[{i}]", m) for i, m in enumerate(self.models)]


def check_safety_field(examples: Sequence, field: str) -> None:
    """ValueError naming the first prompt row (its `source`) whose metadata lacks boolean `field` (reward.gated)."""
    for e in examples:
        if not isinstance(e.metadata.get(field), bool):
            raise ValueError(f"{e.source}: reward.gated.safety_field={field!r} must be a boolean field of every prompt "
                             f"row, got {e.metadata.get(field, '<missing>')!r}")


def step_logits(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, where: torch.Tensor,
                token_ids: tuple[int, int]) -> torch.Tensor:
    """[S, 2] logits (negative, positive) of the reward tokens at the S positions where `where` [B, T] is True.

    The trunk runs over the whole batch; the LM head runs on the S selected hidden states only, and
    at tp > 1 its vocab-sharded logits of those rows are gathered (autograd-aware) before the two
    columns are taken. The one reader of a PRM: its trainer (`megalign.trainers.prm`), best-of-N
    reranking and `ProcessReward` all call it.
    """
    return hidden_step_logits(model, model.model(input_ids, attention_mask), where, token_ids)


def hidden_step_logits(model: CausalLM, hidden: torch.Tensor, where: torch.Tensor,
                       token_ids: tuple[int, int]) -> torch.Tensor:
    """`step_logits` from the trunk's output `hidden` [B, T, H] (on a pipeline, the last stage's): [S, 2]."""
    logits = model.lm_head.gather_logits(model.lm_head(hidden[where]))  # [S, V]
    return logits[:, list(token_ids)]


@torch.no_grad()
def step_probs(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, where: torch.Tensor,
               token_ids: tuple[int, int]) -> torch.Tensor:
    """[S] fp32 p(correct) at the marked positions, in row-major order of `where` (no gradient)."""
    return torch.softmax(step_logits(model, input_ids, attention_mask, where, token_ids).float(), -1)[:, 1]


class ModelReward(Role):
    """A frozen reward model as a role (its "weights" offloadable), with its config's name and weight."""

    def __init__(self, cfg: RewardModelConfig, model: torch.nn.Module, layout: ParallelLayout):
        super().__init__(cfg.name, layout, {"weights": cfg.offload_weights})
        self.model, self.weight = model, cfg.weight
        model.requires_grad_(False).eval()

    def parts(self):
        return {"weights": module_slots(self.model)}

    def trunk_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head, rows: dict[str, torch.Tensor],
                     shape: Sequence[int] = ()) -> torch.Tensor:
        """[N, *shape] fp32 of `head(trunk output [n, T, H], those rows of `rows`) -> [n, *shape]` on the device: the
        whole batch at pp = 1, at pp > 1 the last stage's micro-batches (module doc), on every rank of the pp group."""
        layout = self.layout
        if layout.pp == 1:
            return head(self.model.model(input_ids, attention_mask), rows).float()
        return Pipeline(self.model.model, layout, REWARD_MICROBATCHES_PER_STAGE * layout.pp).score_broadcast(
            input_ids, head, shape, attention_mask=attention_mask, batch=rows)


class OutcomeReward(ModelReward):
    """An outcome reward model: one linear score per response, read from the actor's ids or, with its own
    `tokenizer` (`tokenizer: own`), from the text re-tokenised for it (module doc)."""

    def __init__(self, cfg: RewardModelConfig, model: torch.nn.Module, layout: ParallelLayout,
                 tokenizer: Optional[Tokenizer] = None):
        super().__init__(cfg, model, layout)
        self.tokenizer = tokenizer
        self.max_length = model.config.max_position_embeddings

    @torch.no_grad()
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[N] fp32 (host) scores of prompt + response `sequences` / `attention_mask` [N, P + R]."""
        device = self.layout.device
        mask = attention_mask.to(device)
        return self.trunk_scores(sequences.to(device), mask, lambda hidden, rows: self.model.head(hidden, rows["mask"]),
                                 {"mask": mask}).cpu()

    def encode_texts(self, prompts: Sequence[str], responses: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask) [N, T] (right-padded with its pad id) of the N (prompt, response) texts in this
        model's own tokenizer (module doc); ValueError naming the row when one is longer than its positions."""
        tok = self.tokenizer
        template = getattr(getattr(tok, "hf", None), "chat_template", None) or isinstance(tok, CharTokenizer)
        rows = []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            try:
                if template:
                    ids = tok.apply_chat_template([{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": response}], add_generation_prompt=False)
                else:
                    ids = tok.encode(prompt, add_bos=True) + tok.encode(response) + [tok.eos_id]
            except ValueError as exc:
                raise ValueError(f"reward model {self.name!r} (tokenizer: own, {tok.name}): response {i}: {exc}") from None
            if len(ids) > self.max_length:
                raise ValueError(f"reward model {self.name!r}: response {i} is {len(ids)} tokens in its own tokenizer "
                                 f"({tok.name}) but the model has max_position_embeddings={self.max_length}; lower "
                                 f"rollout.max_response_length or the prompt length")
            rows.append(ids)
        width = max(len(ids) for ids in rows)
        ids = torch.full((len(rows), width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        return ids, mask

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str], sequences: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
        """[N] fp32 (host) scores: of the actor's `sequences` / `attention_mask` [N, P + R], or with its own tokenizer
        of the texts re-tokenised (`encode_texts`)."""
        if self.tokenizer is None:
            return self.score(sequences, attention_mask)
        return self.score(*self.encode_texts(prompts, responses))


class ProcessReward(ModelReward):
    """A process reward model: p(correct) at the end of every step (module doc; `megalign.trainers.prm`).

    `token_ids` (negative, positive) and `separator_ids` come from its `prm.json`, checked against the
    run's tokenizer by the trainer; `eos_id` ends a finished response.
    """

    def __init__(self, cfg: RewardModelConfig, model: CausalLM, layout: ParallelLayout, token_ids: tuple[int, int],
                 separator_ids: Sequence[int], eos_id: int):
        super().__init__(cfg, model, layout)
        self.token_ids, self.separator_ids, self.eos_id = token_ids, list(separator_ids), eos_id
        self.step_score = cfg.step_score

    @torch.no_grad()
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(step rewards [N, R] fp32, step ends bool [N, R]) on the host for `sequences` [N, P + R]."""
        sequences, attention_mask = sequences.cpu(), attention_mask.cpu()
        ends, eos_step = step_ends(sequences[:, -response_width:], attention_mask[:, -response_width:],
                                   self.separator_ids, self.eos_id)
        if not ends.any():
            return torch.zeros(ends.shape), ends
        ids, mask, where = prm_inputs(sequences, attention_mask, response_width, ends, eos_step, self.separator_ids)
        device = self.layout.device

        def head(hidden: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
            out = hidden.new_zeros(rows["where"].shape, dtype=torch.float32)  # [n, T]: p(correct) at the step ends
            logits = hidden_step_logits(self.model, hidden, rows["where"], self.token_ids).float()
            out[rows["where"]] = torch.softmax(logits, -1)[:, 1]
            return out

        where = where.to(device)
        probs = self.trunk_scores(ids.to(device), mask.to(device), head, {"where": where}, where.shape[1:])[where]
        return place_step_scores(probs.cpu(), ends, self.step_score), ends


class Reward:
    """Scores a batch of responses: `score(...) -> (total [N] fp32, per-term values)`, `step_rewards(...)`
    for the process models; `models` are the reward-model and judge roles the trainer places.

    `judges`: the judge roles of `cfg.judges`, in order (`megalign.roles.judge.load_judge` on each one's layout).
    """

    def __init__(self, cfg: RewardConfig, models: Sequence[ModelReward], judges: Sequence[Judge] = ()):
        self.functions = build_reward(cfg.terms, cfg.timeout_s) if cfg.terms else None
        if len(judges) != len(cfg.judges):
            raise ValueError(f"reward.judges lists {len(cfg.judges)} judges but {len(judges)} judge roles were built; "
                             f"the trainer builds one per entry (megalign.roles.judge.load_judge)")
        self.judge_terms = [(j.weight, judge_reward(j, role)) for j, role in zip(cfg.judges, judges)]
        self.judges = list(judges)
        self.models = list(models) + self.judges
        self.outcome = [m for m in self.models if isinstance(m, OutcomeReward)]
        self.process = [m for m in self.models if isinstance(m, ProcessReward)]
        self.gated, self.ensemble = cfg.gated, cfg.ensemble
        paths = {m.name: m.path for _, m in cfg.reward_models()}
        self.ensemble_stats = [reward_stats(paths[name], "reward.ensemble") for name in cfg.ensemble.models] \
            if cfg.ensemble is not None else []
        self.check_with = cfg.check_with
        self.max_failure_fraction = cfg.max_failure_fraction
        term_names = [name for name, _, _ in self.functions.terms] if self.functions is not None else []
        clash = sorted(set(term_names) & {m.name for m in self.models})
        if clash:
            raise ValueError(f"reward model names {clash} are also reward term names; rename one (reward.models[].name "
                             f"or reward.terms[].label)")

    def needs(self) -> dict[str, tuple[str, ...]]:
        """What the scoring phase needs: every reward model's weights (keyword arguments of `place`)."""
        return {m.name: ("weights",) for m in self.models}

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any],
              metadata: Sequence[Mapping[str, Any]], sequences: torch.Tensor,
              attention_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total rewards [N] fp32 and {term name: [N] values} for N responses.

        Text inputs feed the verifier terms; `sequences` / `attention_mask` [N, P + R] (prompt +
        response token ids) feed the outcome reward models, except those with their own tokenizer, which read
        the texts re-tokenised (module doc). The two gated models enter the total only
        through the gated term, an ensemble's members only through its term (module doc). Process models are
        scored by `step_rewards`.
        """
        total = torch.zeros(len(responses))
        terms: dict[str, torch.Tensor] = {}
        if self.functions is not None:
            breakdown = self.functions.score(prompts, responses, answers, metadata)
            total += torch.tensor(breakdown.total)
            terms = {name: torch.tensor(values) for name, values in breakdown.terms.items()}
        for judge in self.judges:
            judge.new_step()
        for weight, fn in self.judge_terms:
            verifier = None if self.functions is None else \
                breakdown.terms[self.check_with] if self.check_with is not None else breakdown.total
            terms[fn.name] = torch.tensor(fn(prompts, responses, answers, metadata, verifier=verifier))
            total += weight * terms[fn.name]
            if isinstance(fn, RubricReward) and fn.mode == "explicit":  # NaN: no item of that category
                terms.update({f"{fn.name}_{k}": torch.tensor(v) for k, v in fn.category_scores.items()})
            if verifier is not None:
                terms[f"{fn.name}_agreement"] = ((terms[fn.name] >= 0.5) == (torch.tensor(verifier) >= 0.5)).float()
        combined = combined_members(self.gated, self.ensemble)
        for m in self.outcome:
            terms[m.name] = m.score_batch(prompts, responses, sequences, attention_mask)
            if m.name not in combined:
                total += m.weight * terms[m.name]
        if self.ensemble is not None:
            name, spread = self.ensemble.terms()
            terms[name], terms[spread] = ensemble_reward(torch.stack([terms[n] for n in self.ensemble.models]),
                                                         *zip(*self.ensemble_stats), self.ensemble.reduce)
            total += self.ensemble.weight * terms[name]
        if self.gated is not None:
            field = self.gated.safety_field
            missing = [i for i, row in enumerate(metadata) if not isinstance(row.get(field), bool)]
            if missing:
                raise ValueError(f"reward.gated.safety_field={field!r}: response {missing[0]}'s prompt row has no "
                                 f"boolean {field!r}")
            is_safety = torch.tensor([row[field] for row in metadata], dtype=torch.bool)
            terms["gated"], branch = gated_reward(terms[self.gated.safety], terms[self.gated.helpful], is_safety,
                                                  self.gated.threshold)
            terms["gated_safety_branch"] = branch.float()
            total += self.gated.weight * terms["gated"]
        return total, terms

    @torch.no_grad()
    def step_rewards(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int
                     ) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
        """(weighted sum of the process models' step rewards [N, R] fp32, or None without process models;
        {name: [N] sum of that model's step rewards, name_steps: [N] its step count}) on the host."""
        if not self.process:
            return None, {}
        total = torch.zeros(sequences.shape[0], response_width)
        terms = {}
        for m in self.process:
            rewards, ends = m.score(sequences, attention_mask, response_width)
            total += m.weight * rewards
            terms[m.name] = rewards.sum(-1)
            terms[f"{m.name}_steps"] = ends.sum(-1).float()
        return total, terms

    def error_counts(self) -> dict[str, float]:
        """Cumulative per-term error and sample counters (`SafeReward.metrics`), and each judge term's verdicts,
        unparsable verdicts and cache hits."""
        out = self.functions.metrics() if self.functions is not None else {}
        for _, fn in self.judge_terms:
            out.update({f"reward/{fn.name}/{k}": fn.metrics()[f"reward/{fn.name}/{k}"]
                        for k in ("verdicts", "unparsed", "cache_hits")})
        return out

    def counters(self) -> dict[str, list[int]]:
        """{term name: [failed samples, scored samples]}, cumulative."""
        return {name: [fn.errors, fn.samples] for name, fn, _ in self.functions.terms} if self.functions else {}

    def check_failures(self, since: Mapping[str, Sequence[int]], group, device: torch.device) -> None:
        """Raise when a term failed on more than `max_failure_fraction` of the samples scored after `counters()`
        returned `since` (summed over `group`, so every rank raises together), chaining the term's last error.

        A verifier that fails on most samples is a bug in the verifier or the data, not noise: training
        on its zeros would finish "successfully" and learn nothing.
        """
        names = list(since)
        if not names:
            return
        now = self.counters()
        local = torch.tensor([[now[n][0] - since[n][0], now[n][1] - since[n][1]] for n in names], dtype=torch.float64)
        total = all_reduce(local.to(device), group).cpu()
        for name, (errors, samples) in zip(names, total.tolist()):
            if samples and errors / samples > self.max_failure_fraction:
                last = dict((n, fn) for n, fn, _ in self.functions.terms)[name].last_error
                raise RuntimeError(
                    f"reward term {name!r} failed on {int(errors)} of {int(samples)} samples this step, more than "
                    f"reward.max_failure_fraction={self.max_failure_fraction}; its last error: {last!r}") from last

    def state_dict(self) -> dict[str, list[int]]:
        """The cumulative error/sample counters of each term, so a resumed run keeps counting."""
        return self.counters()

    def load_state_dict(self, state: Mapping[str, Sequence[int]]) -> None:
        for name, fn, _ in self.functions.terms if self.functions else []:
            fn.errors, fn.samples = (int(v) for v in state[name])
