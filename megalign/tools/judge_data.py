"""The embedded judge's data and its agreement with the verifier (`launch/judge_tools.py data | agreement`).

`write_judge_data(cfg)` writes, from the arithmetic task's fixed train / held-out split
(`megalign.data.judge_rows` for the rows and their labels):

- `judge_train.jsonl`: the judge's SFT rows from the training problems (`prompt` = the filled judge
  template, `response` = "Y" / "N"), the `correct` rows balanced and repeated (`correct_repeats`), for
  `launch/train_sft.py data.path=...`;
- `judge_train_correct.jsonl`: the balanced training rows of the `correct` criterion alone without the hard
  negatives, not repeated, and `judge_train_hard.jsonl`, the same with them: the first two stages of the judge's
  curriculum (`run_embedded.sh judge` trains the comparison on the first, sharpens it on the second, then trains
  all three criteria on `judge_train.jsonl` from that judge; trained on the mix from the start the judge learns
  the two format criteria and not the comparison, and trained on the hard negatives from the start it had not
  learnt the comparison in 600 steps, BENCHMARKS.md "Models in the reward loop");
- `judge_held_out.jsonl`: the same rows from the held-out problems, never trained on, for `agreement`;
- `prompts_train.jsonl`, `prompts_held_out.jsonl`: the GRPO prompt rows with the `rubric` column;
- `constitution.txt` (one principle: the `correct` criterion) and `label.yaml`, the config of RLAIF labels from
  the trained judge (`launch/cai_tools.py label --config label.yaml policy=... judge.path=...`, a pointwise judge
  on `judge_rows.LABEL_TEMPLATE`, the verifier `math_accuracy` for the agreement and the control pairs; 8 pairs
  (16 samples) a prompt, a pair separated only when the accepted response scores >= 0.9 (`accept_at`: fewer of the
  judge's false accepts as chosen; BENCHMARKS.md, the RLAIF runs));
- `reviser_train.jsonl`: SFT rows of a reviser (`judge_rows.reviser_rows`: a critique and a revision row per
  training problem and candidate, the same candidates as the judge's) and `revise.yaml`, the config of SL-CAI's
  `launch/cai_tools.py critique-revise --config revise.yaml policy=... reviser=...` with the templates it was
  trained on and the same constitution.

Candidates are the made-up ones of `synthetic_candidates`, the one-edit-off wrong answers of `hard_negatives`
(source "hard negative"; `hard_negatives: false` leaves them out) and, when `policy` is given,
`samples_per_prompt` samples of that policy per problem (temperature `temperature`): GRPO shows the
judge the policy's own samples, so the judge is trained and measured on them too. Each dp rank samples
its share of the problems (d, d + dp, ...) with a generator seeded by (seed, rank); rank 0 writes
the files atomically in problem order.

`judge_agreement(cfg)` loads the trained judge as the GRPO run will (`load_judge`, `chat_template: false`,
logprob verdicts over the answers "Y" / "N"), scores every held-out row, and reports the fraction whose
verdict (p(Y) >= 1/2) equals the row's label, overall, per criterion, per criterion and label (the rates
on the "Y" and the "N" rows: the labels are unbalanced, most sampled answers being wrong) and per
source, sorted by group name after "all", ending with the
line `judge agreement  NN.N%`; `summary_path` gets the numbers as JSON.

`compare(cfg)` ends an embedded pipeline: the greedy held-out accuracy of the starting policy and of each
trained one, measured by the trainers' own evaluation (`evaluate_generation`) on the same prompts, as
one table (`comparison_lines`) whose last line is `change  +N.N points` of the first trained policy.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megalign.config import atomic_write_text, option
from megalign.data import ArithTaskConfig, PromptExample, build_tokenizer, load_prompts, make_splits
from megalign.data.judge_rows import (CRITERIA, CRITIQUE_TEMPLATE, JUDGE_TEMPLATE, LABEL_TEMPLATE, REVISION_TEMPLATE,
                                      VERDICTS, balanced, hard_negatives, judge_items, repeated, reviser_rows,
                                      rubric_prompt_rows, sft_row, synthetic_candidates)
from megalign.data.prompts import read_rows
from megalign.data.tokenizer import TokenizerConfig
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rewards.judge import JudgeTemplate
from megalign.roles.judge import JudgeConfig, load_judge
from megalign.rollout.generate import SamplingParams
from megalign.trainers.evaluation import EvalConfig, evaluate_generation, generate_responses
from megalign.trainers.model_checks import check_model_path
from megalign.trainers.run_config import resolve_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class JudgeDataConfig:
    """Which problems, which policy samples candidates, where the rows go (module doc)."""

    out_dir: str = option("runs/judge_data", doc="folder of the files of the module doc")
    arith: ArithTaskConfig = option(ArithTaskConfig(), doc="the arithmetic task and its split (the policy's)")
    policy: Optional[str] = option(None, doc="HF folder of the policy whose samples join the candidates; null: "
                                             "the made-up candidates only")
    samples_per_prompt: int = option(8, doc="policy samples per problem (duplicates kept once)")
    temperature: float = option(1.0, doc="sampling temperature of the policy (> 0)")
    max_new_tokens: int = option(16, doc="tokens per policy sample at most (GRPO's max_response_length)")
    batch_size: int = option(512, doc="sequences sampled together on each rank")
    hard_negatives: bool = option(True, doc="add the wrong answers one edit away from the right one "
                                            "(`judge_rows.hard_negatives`); without them a GRPO policy learned the "
                                            "judge's blind spots within 100 steps (BENCHMARKS.md)")
    balance: bool = option(True, doc="repeat the training rows of the rarer `correct` label to balance it "
                                     "(`judge_rows.balanced`); the held-out rows are never repeated")
    correct_repeats: int = option(3, doc="then write every training row of the `correct` criterion this many times "
                                         "(`judge_rows.repeated`: the comparison, not the format criteria, needs the "
                                         "judge's steps); the held-out rows are never repeated")
    seed: int = option(0, doc="seed of the made-up candidates and of the sampling")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")

    def __post_init__(self):
        for name in ("samples_per_prompt", "max_new_tokens", "batch_size", "correct_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def _policy_samples(cfg: JudgeDataConfig, problems, layout: ParallelLayout, split: str) -> list[list[str]]:
    """[len(problems)] lists of the policy's samples (every rank gets all of them, in problem order)."""
    tokenizer = build_tokenizer(TokenizerConfig(kind="auto"), cfg.policy)
    model = from_pretrained(cfg.policy, layout=layout).eval()
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    generator = torch.Generator(device=layout.device).manual_seed(cfg.seed * 1000003 + layout.dp_rank + (split == "held_out"))
    mine = list(range(layout.dp_rank, len(problems), layout.dp))
    k, out = cfg.samples_per_prompt, {}
    per_batch = max(1, cfg.batch_size // k)
    with torch.no_grad():
        for start in range(0, len(mine), per_batch):
            chunk = mine[start:start + per_batch]
            examples = [PromptExample(tokenizer.encode(problems[i].prompt, add_bos=True), problems[i].prompt,
                                      problems[i].answer, {}, f"arith {split} {i}") for i in chunk for _ in range(k)]
            texts, _ = generate_responses(model, examples, tokenizer, params, layout.device, generator)
            out.update({i: texts[j * k:(j + 1) * k] for j, i in enumerate(chunk)})
    gathered = [None] * layout.dp
    dist.all_gather_object(gathered, out)
    merged = {i: texts for part in gathered for i, texts in part.items()}
    return [merged[i] for i in range(len(problems))]


def _write_text(path: str, text: str) -> None:
    """Write `text` atomically unless the file already holds exactly it: the rows are the same on a rerun (seeded),
    and an untouched file lets the stages that trained on it resume (`resume: auto` refuses a changed data file)."""
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return
    atomic_write_text(path, text)


def _write(path: str, rows: list[dict]) -> None:
    _write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def label_counts(items: list[dict]) -> dict[str, dict[str, int]]:
    """{criterion key: {"Y": n, "N": n}} of `items`, to log the balance of the labels."""
    counts: dict[str, dict[str, int]] = {}
    for item in items:
        counts.setdefault(item["key"], {"Y": 0, "N": 0})[VERDICTS[0] if item["label"] else VERDICTS[1]] += 1
    return counts


def write_judge_data(cfg: JudgeDataConfig) -> dict[str, dict]:
    """Write the files of the module doc; returns {split: label counts}. Every rank calls it."""
    if cfg.policy is not None:
        check_model_path(cfg.policy, "policy")
    layout = ParallelLayout.build(tp=1, device_type=resolve_device(cfg.device))
    template = JudgeTemplate(JUDGE_TEMPLATE, "judge_rows.JUDGE_TEMPLATE")
    report = {}
    for split, problems in zip(("train", "held_out"), make_splits(cfg.arith)):
        samples = _policy_samples(cfg, problems, layout, split) if cfg.policy is not None else [[]] * len(problems)
        items, revise = [], []
        for p, sampled in zip(problems, samples):
            items += judge_items(p, sampled, "policy")
            synthetic = [s for s in synthetic_candidates(p, cfg.seed) if s not in sampled]
            items += judge_items(p, synthetic, "synthetic")
            if cfg.hard_negatives:
                seen = set(sampled) | set(synthetic)
                items += judge_items(p, [s for s in hard_negatives(p, cfg.seed) if s not in seen], "hard negative")
            revise += reviser_rows(p, list(sampled) + synthetic_candidates(p, cfg.seed))
        report[split] = label_counts(items)
        rows = items
        if split == "train":
            rows = balanced(rows, "correct") if cfg.balance else rows
            if dist.get_rank() == 0:
                easy = [item for item in items if item["key"] == "correct" and item["source"] != "hard negative"]
                _write(os.path.join(cfg.out_dir, "judge_train_correct.jsonl"),
                       [sft_row(item, template) for item in (balanced(easy, "correct") if cfg.balance else easy)])
                _write(os.path.join(cfg.out_dir, "judge_train_hard.jsonl"),
                       [sft_row(item, template) for item in rows if item["key"] == "correct"])
                _write(os.path.join(cfg.out_dir, "reviser_train.jsonl"), revise)
            rows = repeated(rows, "correct", cfg.correct_repeats)
        logger.info("judge rows %s: %d items of %d problems, %d rows written (balanced / repeated: %s); labels %s", split,
                    len(items), len(problems), len(rows), len(rows) != len(items), report[split])
        if dist.get_rank() == 0:
            _write(os.path.join(cfg.out_dir, f"judge_{split}.jsonl"), [sft_row(item, template) for item in rows])
            _write(os.path.join(cfg.out_dir, f"prompts_{split}.jsonl"), rubric_prompt_rows(problems))
    if dist.get_rank() == 0:
        constitution = os.path.join(os.path.abspath(cfg.out_dir), "constitution.txt")
        _write_text(constitution, CRITERIA["correct"] + "\n")
        label = {"constitution": constitution, "verifier": "math_accuracy", "pairs_per_prompt": 8, "accept_at": 0.9,
                 "judge": {"template": LABEL_TEMPLATE, "answers": list(VERDICTS), "chat_template": False}}
        _write_text(os.path.join(cfg.out_dir, "label.yaml"), json.dumps(label, indent=1) + "\n")  # JSON is YAML
        revise = {"constitution": constitution, "verifier": "math_accuracy", "critique_template": CRITIQUE_TEMPLATE,
                  "revision_template": REVISION_TEMPLATE, "max_new_tokens": cfg.max_new_tokens,
                  "critique_max_new_tokens": 24}
        _write_text(os.path.join(cfg.out_dir, "revise.yaml"), json.dumps(revise, indent=1) + "\n")
    dist.barrier()
    return report


@dataclasses.dataclass
class JudgeAgreementConfig:
    """The trained judge and the held-out rows it is measured on (module doc)."""

    judge: str = option("runs/judge_arith/hf", doc="HF folder of the judge (the judge SFT run's export)")
    items: str = option("runs/judge_data/judge_held_out.jsonl", doc="rows of `write_judge_data` (fields prompt "
                                                                     "[the problem in `problem`], candidate, answer, criterion, label, key, source)")
    micro_batch_size: int = option(256, doc="judge prompts per forward")
    summary_path: Optional[str] = option(None, doc="where to write the numbers as JSON; null: nowhere")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")

    def __post_init__(self):
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")


def _read_items(path: str) -> list[dict]:
    """The held-out rows, each checked for the fields the agreement reads (DataError naming the row otherwise)."""
    items = []
    for source, row in read_rows(path, "judge rows"):
        if isinstance(row, ValueError):
            raise ValueError(f"{source}: {row}")
        missing = [k for k in ("problem", "candidate", "answer", "criterion", "label", "key", "source") if k not in row]
        if missing or not isinstance(row["label"], bool):
            raise ValueError(f"{source}: a judge row needs problem, candidate, answer, criterion, key, source and a bool "
                             f"label (missing {missing}, label {row.get('label')!r})")
        items.append(row)
    if not items:
        raise ValueError(f"{path}: no judge rows")
    return items


def agreement_lines(groups: dict[str, tuple[int, int]]) -> list[str]:
    """One `  <group>  NN.N%  (agree/total)` line per group, then `judge agreement  NN.N%` of group "all"."""
    width = max(len(g) for g in groups)
    lines = [f"  {g:<{width}}  {a / n:6.1%}  ({a}/{n})" for g, (a, n) in groups.items()]
    agree, total = groups["all"]
    return lines + [f"judge agreement  {100 * agree / total:.1f}%"]


def judge_agreement(cfg: JudgeAgreementConfig) -> dict[str, float]:
    """Print and return the judge's agreement with the labels of `cfg.items` (module doc). Every rank calls it."""
    check_model_path(cfg.judge, "judge")
    items = _read_items(cfg.items)
    layout = ParallelLayout.build(tp=1, device_type=resolve_device(cfg.device))
    judge_cfg = JudgeConfig(path=cfg.judge, template=JUDGE_TEMPLATE, answers=list(VERDICTS), chat_template=False,
                            micro_batch_size=cfg.micro_batch_size)
    judge = load_judge("judge", judge_cfg, layout, "judge")
    mine = list(range(layout.dp_rank, len(items), layout.dp))
    rows = [{"prompt": items[i]["problem"], "response": items[i]["candidate"], "reference": str(items[i]["answer"]),
             "criterion": items[i]["criterion"]} for i in mine]
    scores = judge.verdicts(judge.template, rows).scores
    gathered = [None] * layout.dp
    dist.all_gather_object(gathered, list(zip(mine, scores)))
    score = dict(pair for part in gathered for pair in part)
    groups: dict[str, list[int]] = {"all": [0, 0]}
    for i, item in enumerate(items):
        hit = int((score[i] >= 0.5) == item["label"])
        verdict = VERDICTS[0] if item["label"] else VERDICTS[1]
        for g in ("all", f"criterion {item['key']}", f"criterion {item['key']}, label {verdict}",
                  f"source {item['source']}"):
            groups.setdefault(g, [0, 0])
            groups[g][0] += hit
            groups[g][1] += 1
    lines = agreement_lines({g: tuple(groups[g]) for g in sorted(groups, key=lambda g: (g != "all", g))})
    summary = {g: a / n for g, (a, n) in groups.items()}
    if dist.get_rank() == 0:
        print("judge agreement with the labels on held-out (response, criterion) rows:\n" + "\n".join(lines), flush=True)
        if cfg.summary_path is not None:
            atomic_write_text(cfg.summary_path, json.dumps(summary, indent=1) + "\n")
    return summary


@dataclasses.dataclass
class CompareConfig:
    """The policies to compare on the held-out prompts: the starting one and the trained ones (module doc)."""

    before: str = option("runs/sft_arith/hf", doc="HF folder of the policy every run started from")
    after: list[str] = option(["runs/grpo_rubric_arith/hf", "runs/grpo_verifier_arith/hf"],
                              doc="HF folders of the trained policies; the first is the run the `change` line reports, "
                                  "the others its controls")
    names: list[str] = option(["GRPO, rubric reward from the judge", "GRPO, verifier reward (control)"],
                              doc="one table label per `after` folder")
    prompts: str = option("runs/judge_data/prompts_held_out.jsonl", doc="held-out prompt rows (prompt, answer)")
    agreement: Optional[str] = option(None, doc="a `judge_agreement` summary_path to quote its overall agreement; "
                                                "null: none")
    quotes: dict[str, str] = option({}, doc="more fractions to quote under the table, {name: 'FILE.json:dotted.key'}, "
                                            "e.g. {label agreement: runs/rlaif/label_report.json:train.verifier_agreement}")
    max_new_tokens: int = option(16, doc="greedy tokens per response (GRPO's max_response_length)")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")

    def __post_init__(self):
        if not self.after or len(self.names) != len(self.after):
            raise ValueError(f"after needs at least one folder and names one label per folder, got {len(self.after)} "
                             f"folders and {len(self.names)} names")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name, where in self.quotes.items():
            if ":" not in where:
                raise ValueError(f"quotes[{name!r}] = {where!r} must be 'FILE.json:dotted.key'")


def _quoted(where: str) -> float:
    """The number at 'FILE.json:dotted.key' (`CompareConfig.quotes`); ValueError naming the file and the key."""
    path, key = where.rsplit(":", 1)
    with open(path) as fh:
        value = json.load(fh)
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{path} has no {key!r} (no {part!r} there)")
        value = value[part]
    return float(value)


def comparison_lines(before: float, after: list[tuple[str, float]], quotes: Sequence[tuple[str, float]] = ()) -> list[str]:
    """The before/after table: one row per policy with its gain, the first run's gain as a fraction of each
    control's ("-" where the control gained nothing), a `name  NN.N%` line per quoted fraction (the judge's or the labels' agreement), and last
    `change  +N.N points` (the first run's gain)."""
    gains = [(name, (acc - before) * 100) for name, acc in after]
    rows = [("initial policy", f"{before:6.1%}")]
    rows += [(name, f"{acc:6.1%}  ({gain:+.1f} points)") for (name, acc), (_, gain) in zip(after, gains)]
    rows += [(f"gain / {name}'s gain", f"{gains[0][1] / gain:6.1%}" if gain > 0 else "-") for name, gain in gains[1:]]
    width = max(len(name) for name, _ in rows)
    lines = ["held-out accuracy (greedy)"] + [f"  {name:<{width}}  {value}" for name, value in rows]
    lines += [f"{name}  {100 * value:.1f}%" for name, value in quotes]
    return lines + [f"change  {gains[0][1]:+.1f} points"]


def compare(cfg: CompareConfig) -> list[float]:
    """Greedy held-out accuracy of `before` and each `after` (`evaluate_generation`, the trainers' evaluation),
    printed as `comparison_lines`; returns [before, *after]. Every rank calls it (the prompts split over ranks)."""
    for key, path in [("before", cfg.before)] + [(f"after[{i}]", p) for i, p in enumerate(cfg.after)]:
        check_model_path(path, key)
    layout = ParallelLayout.build(tp=1, device_type=resolve_device(cfg.device))
    tokenizer = build_tokenizer(TokenizerConfig(kind="auto"), cfg.before)
    examples = load_prompts(cfg.prompts, tokenizer, 64)
    accuracies = []
    for path in [cfg.before, *cfg.after]:
        model = from_pretrained(path, layout=layout).eval()
        accuracies.append(evaluate_generation(model, examples, tokenizer, EvalConfig(), cfg.max_new_tokens, layout)[0])
    quotes = [("judge agreement", _quoted(f"{cfg.agreement}:all"))] if cfg.agreement is not None else []
    quotes += [(name, _quoted(where)) for name, where in cfg.quotes.items()]
    if dist.get_rank() == 0:
        print("\n".join(comparison_lines(accuracies[0], list(zip(cfg.names, accuracies[1:])), quotes)), flush=True)
    return accuracies
