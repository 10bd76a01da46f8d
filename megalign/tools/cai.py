"""Constitutional AI / RLAIF data from a policy's own samples (Bai et al. 2022, arXiv 2212.08073): AI preference
labels (`label`, RL-CAI's labeller) here, critique-revise (SL-CAI) in `megalign.tools.cai_revise`; both run by
`launch/cai_tools.py`, and both built on the resumable, multi-process chunk runner of this module.

`label(cfg)` (`python launch/cai_tools.py label policy=... judge.path=... judge.template=... [key=value ...]`):
the policy samples two responses per prompt at `temperature` (`pairs_per_prompt` such pairs, each of two
fresh samples); a judge model (`megalign.roles.judge`, `judge.*` keys: any causal-LM folder, logprob or
generate verdicts) reads the template filled with `{prompt}`, `{response_a}`, `{response_b}`, `{reference}`
(the prompt row's answer, which the prompt loader requires, for judges that grade against one) and, when a
`constitution` is given, `{principle}` (one drawn per pair from the prompt's stream) and answers
p(A) = p(response_a is better) (a `generate` judge's parsed number is read as p(A), so its pattern should give
1 for A and 0 for B, or a probability). Position bias
(judges favour one slot) is removed by asking both orders and averaging: p = (p(A | a, b) + 1 - p(A | b, a)) / 2
is the probability that a is better; chosen = a when p > 1/2.
A template with `{response}` instead of the two slots is a pointwise judge (yes / no on one response, the
principle read as a criterion, e.g. the embedded judge of `megalign.data.judge_rows`): it scores each sample
alone, s_a = p(yes | a) and s_b, and p = s_a (1 - s_b) / (s_a (1 - s_b) + s_b (1 - s_a)), the probability that
a is the one meeting the principle given that exactly one does (independent verdicts; 1/2 when both are 0 or
both 1); no position bias to remove. A pointwise judge separates a pair only as a verifier does, one response
judged to meet the principle (s >= 1/2) and the other not: pairs on one side are ties (p alone reads two wrong
answers at s = 0.03 and 0.001 as a confident 0.96). `accept_at` > 1/2 asks more of the accepted side than a reward
does (s >= `accept_at`, the other still < 1/2; else counted as `unsure`): a judge's false accepts score lower than
its true ones (the embedded judge's false accepts on the SFT policy's samples have p(Y) quartiles 0.74 / 0.82 /
0.92), and a pair of two wrong answers with one falsely accepted trains the wrong one as chosen (`run_embedded.sh
rlaif` labels at 0.9; BENCHMARKS.md). Rows are TRL's explicit-prompt preference format (`prompt`, `chosen`,
`rejected`, `answer`) plus `label_probability` (p of the chosen one, in (1/2, 1]),
the two raw verdicts `judge_scores` ([p(A | a, b), p(A | b, a)]; pointwise [s_a, s_b] of a and b), `principle`, and `margin` = log(q / (1 - q))
with q = label_probability clipped to 1 - 1e-3 (the Bradley-Terry reward gap the judge implies, at most 6.9).
`margin` is the soft-label column megalign reads (`megalign.data.preference`): the reward-model trainer
subtracts it in its margin loss (`algo.margin`); the DPO trainer loads the same rows and ignores it.
Left out and counted: pairs with a response cut at `max_new_tokens` (`drop_unfinished`) or empty
(`unfinished`, `empty`), identical responses (`identical`), verdicts the judge could not parse or outside
[0, 1] in either order (`unparsed`), and ties |p - 1/2| <= `tie_tolerance` (`ties`; as online DPO's pairwise judge),
and a pointwise judge's pairs accepted below `accept_at` (`unsure`).
With `verifier` (e.g. `math_accuracy`; the prompts need answers) each pair's verifier preference is kept
(`verifier_preference`: 1 it prefers chosen, 0 rejected, null no preference), the label agreement is
reported (`verifier_agreement` = agreeing / `verifier_decided` among the written rows), and
`pairs_verifier.jsonl` holds the verifier-labelled pairs of the same samples (every sampled pair the
verifier orders, whatever the judge said), the control of `run_embedded.sh rlaif`.

CLI keys (`--help` lists them with defaults): the shared ones of `CAIConfig` (`policy`, `out_dir`, `data.*`,
`num_prompts`, `held_out`, `constitution`, `temperature`, `max_new_tokens`, `chunk_size`, `engine.*`,
`verifier`, `drop_unfinished`, `seed`, `device`); `label`: `judge.*` (path, template, mode, answers, pattern,
...), `tie_tolerance`, `accept_at`, `margin`; `critique-revise`: see `megalign.tools.cai_revise`.

Design choices (both commands):

- Work unit = a chunk of `chunk_size` consecutive prompts; chunk c runs on dp rank c % dp and is written
  atomically as out_dir/chunks/<command>-<split>/<c>.json (rows + counts): the done-index. A restarted run
  skips the chunks on disk, so a crash loses at most the chunks in flight and never writes a row twice;
  when all are done rank 0 concatenates them in prompt order into the final files (atomic). out_dir must
  be on a file system every process sees (like a run_dir). out_dir/chunks/<command>.json keeps the
  config (and the principles) the chunks were made with; a restart with a different one is refused
  naming the keys (`device`, `engine`, `held_out` may change).
- Reproducible whatever the process count or the restarts: samples come from the rollout engine's
  per-sample streams keyed by (seed of the stage, global prompt index, sample) (`megalign.rollout.rollout`),
  principles from a per-prompt `random.Random(f"{seed}/{split}/{index}")`, and a chunk's prompts are the
  same batch wherever it runs, so 1 process, 2 processes and a resumed run write the same rows.
- Testing aid: the environment variable MEGALIGN_CAI_STOP_AFTER=k makes each rank raise `Interrupted`
  after writing k chunks (a crash at a chunk boundary).
- tp = pp = 1 for the policy and the judge (these tools run small models; scale is the process count).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import zlib
from collections import Counter
from typing import Any, Callable, Literal, Optional, Sequence

import torch
import torch.distributed as dist
import yaml

from megalign.config import atomic_write_text, option
from megalign.data import PromptExample, build_tokenizer
from megalign.data.tokenizer import Tokenizer
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rewards import get_reward
from megalign.rewards.judge import JudgeTemplate
from megalign.roles.judge import JudgeConfig, load_judge
from megalign.rollout import EngineConfig, SamplingParams, rollout
from megalign.trainers.evaluation import left_pad
from megalign.trainers.model_checks import check_model_path
from megalign.trainers.online_config import PromptDataConfig, prompt_datasets
from megalign.trainers.run_config import resolve_device

logger = logging.getLogger(__name__)

STOP_ENV = "MEGALIGN_CAI_STOP_AFTER"
"""Raise `Interrupted` on each rank after it wrote this many chunks (module doc; for resume tests)."""
RESUME_FREE_KEYS = ("device", "engine", "held_out")
"""Config keys a restarted run may change: they never change the rows."""


class Interrupted(RuntimeError):
    """Raised by a rank that wrote MEGALIGN_CAI_STOP_AFTER chunks (a simulated crash between chunks)."""


def load_constitution(path: str, key: str = "constitution") -> list[str]:
    """The principles of a constitution file: a JSON (.json) or YAML (.yaml / .yml) list of non-empty strings, or
    any other file with one principle per line. ValueError naming the file (and line or item) otherwise."""
    if not os.path.isfile(path):
        raise ValueError(f"{key}={path!r} is not a file")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if not text.strip():
        raise ValueError(f"{key}: {path} is empty; it needs at least one principle")
    if path.endswith((".json", ".yaml", ".yml")):
        try:
            items = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise ValueError(f"{key}: {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'} ({exc})") from exc
        if not isinstance(items, list) or not items:
            raise ValueError(f"{key}: {path} must hold a non-empty list of principles, got {type(items).__name__}")
        for i, item in enumerate(items):
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"{key}: {path} item {i} must be a non-empty string, got {item!r}")
        return [item.strip() for item in items]
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line
    for i, line in enumerate(lines):
        if not line.strip():
            raise ValueError(f"{key}: {path}:{i + 1} is an empty line; write one principle per line")
    return [line.strip() for line in lines]


@dataclasses.dataclass
class CAIConfig:
    """What both CAI tools share: the policy that samples, the prompts, the constitution, chunks and seeds."""

    policy: str = option("runs/sft_arith/hf", doc="HF checkpoint folder of the policy that samples the responses")
    out_dir: str = option("runs/cai", doc="folder of the output files and of the chunks/ a restart resumes from")
    data: PromptDataConfig = option(PromptDataConfig(), doc="prompts (with answers for the verifier): the arithmetic "
                                                            "task by default, or a .jsonl / .parquet file")
    num_prompts: int = option(0, doc="use the first this many prompts of each split; 0: all")
    held_out: bool = option(False, doc="also process the held-out split (files *_held_out.jsonl)")
    constitution: Optional[str] = option(None, doc="file of principles: one per line, or a JSON / YAML list")
    temperature: float = option(1.0, doc="sampling temperature of the policy's responses (> 0)")
    max_new_tokens: int = option(16, doc="generated tokens per response at most")
    chunk_size: int = option(32, doc="prompts per chunk: the unit of work split over processes and of resume")
    engine: EngineConfig = option(EngineConfig(), doc="how the rollout engine batches; never changes the samples")
    verifier: Optional[str] = option(None, doc="a verifier (e.g. math_accuracy, or 'module:function') scoring the "
                                               "responses against the prompts' answers; null: none")
    drop_unfinished: bool = option(True, doc="leave out (and count) responses cut at max_new_tokens (no EOS)")
    seed: int = option(0, doc="seed of the samples and of the principle draws")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")

    def __post_init__(self):
        for name in ("max_new_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_prompts < 0:
            raise ValueError(f"num_prompts must be >= 0 (0: all), got {self.num_prompts}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        self.principles = load_constitution(self.constitution) if self.constitution is not None else []
        if self.verifier is not None:
            get_reward(self.verifier)

    def manifest(self) -> dict[str, Any]:
        """What the chunks depend on: the config without `RESUME_FREE_KEYS`, with the principles themselves in place
        of the constitution's path (a moved file with the same principles resumes)."""
        values = json.loads(json.dumps(dataclasses.asdict(self), default=str))
        skip = (*RESUME_FREE_KEYS, "constitution")
        return {**{k: v for k, v in values.items() if k not in skip}, "principles": self.principles}


def stage_seed(seed: int, split: str, stage: str) -> int:
    """The rollout seed of one sampling stage (initial responses, critique r, ...) of one split."""
    return (seed * 1000003 + zlib.crc32(f"{split}/{stage}".encode())) % (1 << 62)


def principle_stream(seed: int, split: str, index: int) -> random.Random:
    """Prompt `index`'s own stream of principle draws: the same whatever process or chunk handles it."""
    return random.Random(f"{seed}/{split}/{index}")


@torch.no_grad()
def sample(model, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], keys: Sequence[int], group: int,
           params: SamplingParams, seed: int, engine: EngineConfig) -> tuple[list[str], list[bool]]:
    """(decoded responses [U * group], whether each stopped by itself) of `group` samples of each prompt (ids),
    prompt-major; sample g of prompt key k depends only on (seed, k, g) (`megalign.rollout.rollout`)."""
    ids, mask = left_pad(prompts, tokenizer.pad_id, next(model.parameters()).device)
    out, _ = rollout(model, ids, mask, group, params, seed, engine, prompt_keys=list(keys))
    width = ids.shape[1]
    tokens, real = out.sequences[:, width:].cpu(), out.attention_mask[:, width:].bool().cpu()
    stop = set(params.stop_ids)
    texts, finished = [], []
    for row, keep in zip(tokens, real):
        kept = row[keep].tolist()
        texts.append(tokenizer.decode(kept))
        finished.append(bool(kept) and kept[-1] in stop)
    return texts, finished


def verifier_scores(cfg: CAIConfig, examples: Sequence[PromptExample], responses: Sequence[str]) -> list[float]:
    """`cfg.verifier`'s score of each response to its example's prompt and answer."""
    metric = get_reward(cfg.verifier)
    return [float(s) for s in metric([e.prompt_text for e in examples], list(responses), [e.answer for e in examples],
                                     [e.metadata for e in examples])]


def _check_manifest(cfg: CAIConfig, command: str) -> None:
    """Refuse to resume chunks made with another config (module doc); record the config on a fresh start."""
    path = os.path.join(cfg.out_dir, "chunks", f"{command}.json")
    mine = cfg.manifest()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            old = json.load(fh)
        changed = sorted(k for k in set(old) | set(mine) if old.get(k) != mine.get(k))
        if changed:
            raise ValueError(f"{cfg.out_dir} holds {command} chunks made with other values of {', '.join(changed)} "
                             f"({path}); use another out_dir or delete its chunks/ folder to start over")
    dist.barrier()
    if dist.get_rank() == 0 and not os.path.exists(path):
        atomic_write_text(path, json.dumps(mine, indent=1) + "\n")
    dist.barrier()


Work = Callable[[str, list[PromptExample], int], dict[str, Any]]
"""(split, a chunk's examples, the global index of its first) -> {"files": {name: rows}, "counts": {name: int}}."""


def run_chunks(cfg: CAIConfig, command: str, work: Work, layout: ParallelLayout,
               summary: Callable[[dict[str, int]], dict[str, Any]] = dict) -> dict[str, dict[str, Any]]:
    """Run `work` over every split's prompts chunk by chunk, resumably, and write the merged files (module doc).

    Returns {split: counts} (summed over the chunks, then passed through `summary`), on every rank; rank 0 also
    writes it to out_dir/<command>_report.json (e.g. the label agreement a pipeline's table quotes).
    """
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.policy)
    train, held_out = prompt_datasets(cfg.data, tokenizer, cfg.out_dir)
    _check_manifest(cfg, command)
    stop_after = int(os.environ.get(STOP_ENV, "0") or 0)
    report, written = {}, 0
    for split, dataset in (("train", train), ("held_out", held_out if cfg.held_out else None)):
        if dataset is None:
            continue
        examples = dataset.examples[:cfg.num_prompts or None]
        folder = os.path.join(cfg.out_dir, "chunks", f"{command}-{split}")
        n = math.ceil(len(examples) / cfg.chunk_size)
        done = 0
        for c in range(layout.dp_rank, n, layout.dp):
            path = os.path.join(folder, f"{c:06d}.json")
            if os.path.exists(path):
                done += 1
                continue
            start = c * cfg.chunk_size
            atomic_write_text(path, json.dumps(work(split, examples[start:start + cfg.chunk_size], start)))
            written += 1
            if stop_after and written >= stop_after:
                raise Interrupted(f"rank {layout.dp_rank}: stopped after {written} chunks ({STOP_ENV}={stop_after})")
        if done:
            logger.info("%s %s: %d chunks of this rank were done before, skipped", command, split, done)
        dist.barrier()
        report[split] = summary(_merge(folder, n, split, cfg.out_dir) if dist.get_rank() == 0 else {})
        holder = [report[split]]
        dist.broadcast_object_list(holder, src=0)
        report[split] = holder[0]
        logger.info("%s %s: %s", command, split, report[split])
    if dist.get_rank() == 0:
        atomic_write_text(os.path.join(cfg.out_dir, f"{command}_report.json"), json.dumps(report, indent=1) + "\n")
    dist.barrier()
    return report


def _merge(folder: str, n: int, split: str, out_dir: str) -> dict[str, int]:
    """Concatenate the n chunk files in prompt order into out_dir/<name>[_held_out].jsonl; the summed counts."""
    files: dict[str, list[str]] = {}
    counts: Counter = Counter()
    for c in range(n):
        with open(os.path.join(folder, f"{c:06d}.json"), encoding="utf-8") as fh:
            part = json.load(fh)
        for name, rows in part["files"].items():
            files.setdefault(name, []).extend(json.dumps(row) + "\n" for row in rows)
        counts.update(part["counts"])
    for name, lines in files.items():
        atomic_write_text(os.path.join(out_dir, f"{name}{'' if split == 'train' else '_held_out'}.jsonl"), "".join(lines))
    return dict(counts)


@dataclasses.dataclass
class LabelConfig(CAIConfig):
    """RL-CAI preference labels: two policy samples per prompt, ordered by a judge model (module doc)."""

    judge: Optional[JudgeConfig] = option(None, doc="(required) the judge: path, template with {response_a} and "
                                                    "{response_b} (and {prompt}, {principle}), verdict mode, answers")
    tie_tolerance: float = option(0.0, doc="leave out (and count) pairs with |p - 1/2| <= this: ties")
    pairs_per_prompt: int = option(1, doc="pairs labelled per prompt, each of two fresh samples (2 x this samples), "
                                          "each with its own principle")
    accept_at: float = option(0.5, doc="pointwise judge: a pair is separated only when one verdict is >= this and "
                                       "the other < 1/2 (else counted as `unsure`); > 1/2 against false accepts")
    margin: bool = option(True, doc="write the `margin` column log(q / (1 - q)) of the label probability q")

    def __post_init__(self):
        super().__post_init__()
        if self.judge is None:
            raise ValueError("judge is required (judge.path=HF folder judge.template=...)")
        if self.judge.tp != 1 or self.judge.pp != 1:
            raise ValueError(f"judge.tp and judge.pp must be 1 in the CAI tools, got {self.judge.tp}, {self.judge.pp}")
        if not 0 <= self.tie_tolerance < 0.5:
            raise ValueError(f"tie_tolerance must be in [0, 0.5), got {self.tie_tolerance}")
        if self.pairs_per_prompt < 1:
            raise ValueError(f"pairs_per_prompt must be >= 1, got {self.pairs_per_prompt}")
        if not 0.5 <= self.accept_at <= 1.0:
            raise ValueError(f"accept_at must be in [0.5, 1], got {self.accept_at}")
        if self.accept_at != 0.5 and not self.pointwise:
            raise ValueError("accept_at applies to a pointwise judge (a judge.template with {response}); a pairwise "
                             "judge's confidence threshold is tie_tolerance")
        slots = ("response",) if self.pointwise else ("response_a", "response_b")
        supplied = ("prompt", *slots, "reference") + (("principle",) if self.principles else ())
        JudgeTemplate(self.judge.template, "judge.template").check(
            supplied, slots, "label" + ("" if self.principles else " without a constitution"))

    @property
    def pointwise(self) -> bool:
        """Whether the judge scores one response at a time (its template has `{response}`; module doc)."""
        return "response" in JudgeTemplate(self.judge.template, "judge.template").fields


def _pair_verdict(s_ab: float, s_ba: float, ok: bool, pointwise: bool = False) -> Optional[float]:
    """p(a better than b), or None when either verdict is unusable (module doc): from the verdicts of both orders,
    or with `pointwise` from the two responses' own verdicts s_a = `s_ab`, s_b = `s_ba`."""
    if not ok or not (0.0 <= s_ab <= 1.0 and 0.0 <= s_ba <= 1.0):
        return None
    if not pointwise:
        return (s_ab + 1.0 - s_ba) / 2.0
    a_only, b_only = s_ab * (1.0 - s_ba), s_ba * (1.0 - s_ab)
    return 0.5 if a_only + b_only == 0.0 else a_only / (a_only + b_only)


class _Labeller:
    """`label`'s work on one chunk: sample two responses a prompt, ask the judge both orders, write rows."""

    def __init__(self, cfg: LabelConfig, layout: ParallelLayout):
        self.cfg = cfg
        self.tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.policy)
        self.policy = from_pretrained(cfg.policy, layout=layout).eval()
        self.judge = load_judge("judge", cfg.judge, layout)
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                     eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id)

    def __call__(self, split: str, chunk: list[PromptExample], start: int) -> dict[str, Any]:
        cfg = self.cfg
        k = cfg.pairs_per_prompt
        texts, finished = sample(self.policy, self.tokenizer, [e.prompt_ids for e in chunk],
                                 range(start, start + len(chunk)), 2 * k, self.params,
                                 stage_seed(cfg.seed, split, "samples"), cfg.engine)
        counts = Counter(prompts=len(chunk), responses=len(texts), finished=sum(finished))
        pairs = []  # (example, a, b, principle)
        for i, e in enumerate(chunk):
            stream = principle_stream(cfg.seed, split, start + i)
            for x, y in ((2 * k * i + 2 * j, 2 * k * i + 2 * j + 1) for j in range(k)):
                a, b = texts[x], texts[y]
                principle = stream.choice(cfg.principles) if cfg.principles else ""  # drawn for every pair
                reason = ("unfinished" if cfg.drop_unfinished and not (finished[x] and finished[y]) else
                          "empty" if not a.strip() or not b.strip() else "identical" if a == b else None)
                if reason is not None:
                    counts[reason] += 1
                    continue
                pairs.append((e, a, b, principle))
        verdicts = self.judge.verdicts(self.judge.template, self._judge_rows(pairs))
        self.judge.new_step()
        verifier = verifier_scores(cfg, [e for e, *_ in pairs for _ in (0, 1)], [t for _, a, b, _ in pairs
                                                                                  for t in (a, b)]) \
            if cfg.verifier and pairs else None
        return self._rows(pairs, verdicts, verifier, counts)

    def _judge_rows(self, pairs) -> list[dict[str, str]]:
        """The judge's filled fields: pointwise a_0, b_0, a_1, ...; else every pair as (a, b), then all as (b, a)."""
        rows = []
        for e, a, b, principle in pairs:
            common = {"prompt": e.prompt_text, "reference": str(e.answer), "principle": principle}
            rows += ([{**common, "response": a}, {**common, "response": b}] if self.cfg.pointwise else
                     [{**common, "response_a": a, "response_b": b}])
        if self.cfg.pointwise:
            return rows
        return rows + [{**row, "response_a": row["response_b"], "response_b": row["response_a"]} for row in rows]

    def _rows(self, pairs, verdicts, verifier, counts: Counter) -> dict[str, Any]:
        n, out, control, pointwise = len(pairs), [], [], self.cfg.pointwise
        for j, (e, a, b, principle) in enumerate(pairs):
            ia, ib = (2 * j, 2 * j + 1) if pointwise else (j, n + j)
            s_ab, s_ba = verdicts.scores[ia], verdicts.scores[ib]
            prefers = None  # the verifier's choice: "a", "b" or None
            if verifier is not None and verifier[2 * j] != verifier[2 * j + 1]:
                prefers = "a" if verifier[2 * j] > verifier[2 * j + 1] else "b"
                good, bad = (a, b) if prefers == "a" else (b, a)
                control.append({"prompt": e.prompt_text, "chosen": good, "rejected": bad, "answer": e.answer})
            p = _pair_verdict(s_ab, s_ba, verdicts.parsed[ia] and verdicts.parsed[ib], pointwise)
            if p is None:
                counts["unparsed"] += 1
                continue
            if abs(p - 0.5) <= self.cfg.tie_tolerance or (pointwise and (s_ab >= 0.5) == (s_ba >= 0.5)):
                counts["ties"] += 1
                continue
            if pointwise and max(s_ab, s_ba) < self.cfg.accept_at:
                counts["unsure"] += 1
                continue
            chosen, rejected, q, side = (a, b, p, "a") if p > 0.5 else (b, a, 1.0 - p, "b")
            if not pointwise:
                counts["position_consistent"] += (s_ab > 0.5) == (s_ba < 0.5)
            row = {"prompt": e.prompt_text, "chosen": chosen, "rejected": rejected, "answer": e.answer,
                   "label_probability": q, "judge_scores": [s_ab, s_ba], "principle": principle}
            if self.cfg.margin:
                row["margin"] = math.log(min(q, 1 - 1e-3) / (1.0 - min(q, 1 - 1e-3)))
            if verifier is not None:
                row["verifier_preference"] = None if prefers is None else int(prefers == side)
                counts["verifier_decided"] += prefers is not None
                counts["verifier_agree"] += prefers == side
            out.append(row)
        counts["pairs"] = len(out)
        files = {"pairs": out, **({"pairs_verifier": control} if self.cfg.verifier else {})}
        return {"files": files, "counts": dict(counts)}


def _label_summary(counts: dict[str, int]) -> dict[str, Any]:
    """The summed counts, with the label agreement with the verifier when one scored the pairs."""
    out: dict[str, Any] = dict(counts)
    if out.get("verifier_decided"):
        out["verifier_agreement"] = out["verifier_agree"] / out["verifier_decided"]
    return out


def label(cfg: LabelConfig) -> dict[str, dict[str, Any]]:
    """Write out_dir/pairs.jsonl (and pairs_verifier.jsonl, *_held_out.jsonl); returns {split: counts}. Every rank
    calls it (module doc)."""
    check_model_path(cfg.policy, "policy")
    check_model_path(cfg.judge.path, "judge.path")
    layout = ParallelLayout.build(tp=1, device_type=resolve_device(cfg.device))
    return run_chunks(cfg, "label", _Labeller(cfg, layout), layout, _label_summary)
