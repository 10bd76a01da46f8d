"""SL-CAI critique-revise data (Bai et al. 2022, arXiv 2212.08073, section 3): `critique_revise(cfg)`, run by
`python launch/cai_tools.py critique-revise policy=DIR constitution=FILE [rounds=N reviser=DIR key=value ...]`.

Per prompt the policy samples a response at `temperature`; then each of `rounds` rounds draws a principle from
the prompt's own seeded stream over the constitution, asks the reviser (the policy by default, or the
`reviser` folder) for a critique of the current response against it (`critique_template`, fields
`{prompt}`, `{response}`, `{principle}`), then for a revision (`revision_template`, the same fields and
`{critique}`); the revision becomes the current response. The rows are SFT rows with the final response:
`prompt` and `response` (what megalign's SFT trainer reads, `megalign.data.sft`), the same text again as
`completion` (TRL's prompt-completion format), `answer`, and the whole trace in extra columns (ignored by
the trainers): `initial_response` and `revisions`, a list of {principle, critique, revision, accepted}
per round; with a `verifier`, `initial_score` and `final_score`, and the report gives both accuracies over
the written rows (`initial_accuracy`, `final_accuracy`). `sft_initial.jsonl` holds the same prompts with their
initial responses instead (an empty one left out, counted as `initial_empty`): SL-CAI's ablation, SFT on the
samples before any revision (the control of `run_embedded.sh critique_revise`).

CLI keys: the shared ones of `megalign.tools.cai.CAIConfig` (`policy`, `out_dir`, `data.*`, `num_prompts`,
`held_out`, `constitution` (required here), `temperature`, `max_new_tokens` (initial responses and revisions),
`chunk_size`, `engine.*`, `verifier`, `drop_unfinished`, `seed`, `device`) and `rounds`, `reviser`,
`critique_template`, `revision_template`, `critique_max_new_tokens`, `critique_temperature`, `chat_template`.

Design choices:

- A filled template is the reviser's whole prompt: BOS + text, or (`chat_template: true`) one user message
  through the reviser's chat template. Critiques and revisions are sampled at `critique_temperature`
  (0: greedy, the default) on the rollout engine, each round and stage with its own seed, keyed by the
  global prompt index, so the rows do not depend on the process count (`megalign.tools.cai` module doc,
  which also describes the chunked output, the resume and the config check of a restart).
- A revision is accepted only when it is non-empty and, with `drop_unfinished`, ended by EOS; otherwise the
  round keeps the current response (`accepted: false`, counted as `rejected_revisions`). A round whose
  critique or revision prompt does not fit the reviser's positions with its new tokens is skipped the same
  way (counted as `too_long`). A critique cut at `critique_max_new_tokens` is still used (counted as
  `unfinished_critiques`). Rows whose final response is empty or (with `drop_unfinished`) unfinished are
  left out and counted (`empty`, `unfinished`).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Any, Optional, Sequence

from megalign.config import option
from megalign.data import PromptExample, build_tokenizer
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rewards.judge import JudgeTemplate
from megalign.rollout import SamplingParams
from megalign.tools.cai import CAIConfig, principle_stream, run_chunks, sample, stage_seed, verifier_scores
from megalign.trainers.model_checks import check_model_path
from megalign.trainers.run_config import resolve_device

logger = logging.getLogger(__name__)

CRITIQUE_TEMPLATE = "{prompt}{response}\n\nCritique request: {principle}\nCritique:"
REVISION_TEMPLATE = ("{prompt}{response}\n\nCritique request: {principle}\nCritique:{critique}\n"
                     "Revision request: rewrite the response so that it follows the principle.\nRevision:")


@dataclasses.dataclass
class CritiqueReviseConfig(CAIConfig):
    """SL-CAI: sample, then critique and revise against principles drawn from a constitution (module doc)."""

    rounds: int = option(1, doc="critique-revision rounds per prompt, each with a freshly drawn principle")
    reviser: Optional[str] = option(None, doc="HF folder of the model that critiques and revises; null: the policy")
    critique_template: str = option(CRITIQUE_TEMPLATE, doc="critique prompt (fields {prompt}, {response}, "
                                                           "{principle}), or the path of a file holding it")
    revision_template: str = option(REVISION_TEMPLATE, doc="revision prompt (fields {prompt}, {response}, "
                                                           "{principle}, {critique}), or a file path")
    critique_max_new_tokens: int = option(32, doc="generated tokens per critique at most")
    critique_temperature: float = option(0.0, doc="sampling temperature of critiques and revisions (0: greedy)")
    chat_template: bool = option(False, doc="render a filled template as a user message with the reviser's chat "
                                            "template; false: BOS + the raw text")

    def __post_init__(self):
        super().__post_init__()
        if not self.principles:
            raise ValueError("critique-revise needs a constitution (constitution=FILE of principles)")
        if self.rounds < 1 or self.critique_max_new_tokens < 1:
            raise ValueError(f"rounds and critique_max_new_tokens must be >= 1, got {self.rounds}, "
                             f"{self.critique_max_new_tokens}")
        if not self.critique_temperature >= 0:
            raise ValueError(f"critique_temperature must be >= 0 (0: greedy), got {self.critique_temperature}")
        JudgeTemplate(self.critique_template, "critique_template").check(
            ("prompt", "response", "principle"), ("response", "principle"), "critique-revise's critique")
        JudgeTemplate(self.revision_template, "revision_template").check(
            ("prompt", "response", "principle", "critique"), ("response", "critique"), "critique-revise's revision")


class _Reviser:
    """`critique-revise`'s work on one chunk (module doc)."""

    def __init__(self, cfg: CritiqueReviseConfig, layout: ParallelLayout):
        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.policy)
        self.policy = from_pretrained(cfg.policy, layout=layout).eval()
        if cfg.reviser is None:
            self.reviser, self.reviser_tokenizer = self.policy, self.tokenizer
        else:
            self.reviser_tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.reviser)
            self.reviser = from_pretrained(cfg.reviser, layout=layout).eval()
        if cfg.chat_template:  # fails now, naming the tokenizer, when it has no template
            self.reviser_tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
        self.templates = {"critique": JudgeTemplate(cfg.critique_template, "critique_template"),
                          "revision": JudgeTemplate(cfg.revision_template, "revision_template")}

    def _params(self, tokenizer, temperature: float, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=tokenizer.eos_id,
                              pad_token_id=tokenizer.pad_id)

    def _encode(self, text: str) -> list[int]:
        tok = self.reviser_tokenizer
        if self.cfg.chat_template:
            return tok.apply_chat_template([{"role": "user", "content": text}])
        return tok.encode(text, add_bos=True)

    def _ask(self, stage: str, round_: int, fields: Sequence[dict], keys: Sequence[int], split: str,
             counts: Counter) -> list[Optional[tuple[str, bool]]]:
        """(text, finished) of the reviser's answer to each filled template, None where the prompt does not fit."""
        max_new = self.cfg.critique_max_new_tokens if stage == "critique" else self.cfg.max_new_tokens
        limit = self.reviser.config.max_position_embeddings - max_new
        ids = [self._encode(self.templates[stage].render(f)) if f is not None else None for f in fields]
        fit = [i for i, x in enumerate(ids) if x is not None and len(x) <= limit]
        counts["too_long"] += sum(x is not None for x in ids) - len(fit)
        out: list[Optional[tuple[str, bool]]] = [None] * len(fields)
        if fit:
            texts, finished = sample(self.reviser, self.reviser_tokenizer, [ids[i] for i in fit], [keys[i] for i in fit],
                                     1, self._params(self.reviser_tokenizer, self.cfg.critique_temperature, max_new),
                                     stage_seed(self.cfg.seed, split, f"{stage}{round_}"), self.cfg.engine)
            for i, t, f in zip(fit, texts, finished):
                out[i] = (t, f)
        return out

    def __call__(self, split: str, chunk: list[PromptExample], start: int) -> dict[str, Any]:
        cfg = self.cfg
        keys = list(range(start, start + len(chunk)))
        current, done = sample(self.policy, self.tokenizer, [e.prompt_ids for e in chunk], keys, 1,
                               self._params(self.tokenizer, cfg.temperature, cfg.max_new_tokens),
                               stage_seed(cfg.seed, split, "initial"), cfg.engine)
        initial = list(current)
        streams = [principle_stream(cfg.seed, split, i) for i in keys]
        traces: list[list[dict]] = [[] for _ in chunk]
        counts = Counter(prompts=len(chunk))
        for r in range(cfg.rounds):
            fields = [{"prompt": e.prompt_text, "response": current[i], "principle": streams[i].choice(cfg.principles)}
                      for i, e in enumerate(chunk)]
            critiques = self._ask("critique", r, fields, keys, split, counts)
            counts["unfinished_critiques"] += sum(c is not None and not c[1] for c in critiques)
            asked = [None if c is None else {**f, "critique": c[0]} for f, c in zip(fields, critiques)]
            revisions = self._ask("revision", r, asked, keys, split, counts)
            for i, (f, c, v) in enumerate(zip(fields, critiques, revisions)):
                accepted = v is not None and bool(v[0].strip()) and (v[1] or not cfg.drop_unfinished)
                counts["rejected_revisions"] += v is not None and not accepted
                traces[i].append({"principle": f["principle"], "critique": None if c is None else c[0],
                                  "revision": None if v is None else v[0], "accepted": accepted})
                if accepted:
                    current[i], done[i] = v
        return self._rows(chunk, initial, current, done, traces, counts)

    def _rows(self, chunk, initial, final, done, traces, counts: Counter) -> dict[str, Any]:
        cfg = self.cfg
        scores = (verifier_scores(cfg, list(chunk) * 2, list(initial) + list(final)) if cfg.verifier
                  else [None] * (2 * len(chunk)))
        rows, control = [], []
        for i, e in enumerate(chunk):
            reason = "empty" if not final[i].strip() else "unfinished" if cfg.drop_unfinished and not done[i] else None
            if reason is not None:
                counts[reason] += 1
                continue
            if initial[i].strip():
                control.append({"prompt": e.prompt_text, "response": initial[i], "completion": initial[i],
                                "answer": e.answer})
            else:
                counts["initial_empty"] += 1
            row = {"prompt": e.prompt_text, "response": final[i], "completion": final[i], "answer": e.answer,
                   "initial_response": initial[i], "revisions": traces[i]}
            if cfg.verifier:
                row["initial_score"], row["final_score"] = scores[i], scores[len(chunk) + i]
                counts["initial_score_sum"] += scores[i]
                counts["final_score_sum"] += scores[len(chunk) + i]
            rows.append(row)
        counts["rows"] = len(rows)
        return {"files": {"sft": rows, "sft_initial": control}, "counts": dict(counts)}


def _summary(counts: dict[str, Any]) -> dict[str, Any]:
    """The summed counts, with the verifier's mean score of the initial and the final responses of the rows."""
    out = dict(counts)
    if out.get("rows") and "initial_score_sum" in out:
        out["initial_accuracy"] = out.pop("initial_score_sum") / out["rows"]
        out["final_accuracy"] = out.pop("final_score_sum") / out["rows"]
    return out


def critique_revise(cfg: CritiqueReviseConfig) -> dict[str, dict[str, Any]]:
    """Write out_dir/sft.jsonl and sft_initial.jsonl (and their *_held_out.jsonl); returns {split: counts}. Every rank calls it (module doc)."""
    check_model_path(cfg.policy, "policy")
    if cfg.reviser is not None:
        check_model_path(cfg.reviser, "reviser")
    layout = ParallelLayout.build(tp=1, device_type=resolve_device(cfg.device))
    return run_chunks(cfg, "critique-revise", _Reviser(cfg, layout), layout, _summary)
