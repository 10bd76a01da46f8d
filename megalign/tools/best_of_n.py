"""Process supervision from a policy's own samples: Monte-Carlo step labels and best-of-N reranking.

`label_steps` (`launch/prm_tools.py label`) builds PRM training data the Math-Shepherd way (Wang et al.
2024, arXiv 2312.08935): the policy samples `samples` solutions per training prompt; every step of a
solution but its last is labelled by `completions` further samples from the prefix that ends with
that step, as the fraction of them reaching the right answer (soft, SE) or whether any does (hard,
HE; `megalign.algos.math_shepherd_labels`); the last step (the final answer) gets the outcome itself,
which is what completing a finished solution would give. Rows are TRL's stepwise format with the
gold `answer` kept, so the same file trains a PRM (`algo.supervise: steps`) and an outcome RM on the
same samples (`algo.supervise: outcome`, the last label only).

`best_of_n` (`launch/prm_tools.py best_of_n`) measures what a verifier buys at test time: on held-out prompts,
greedy accuracy, then `n` samples per prompt reranked by the PRM (the solution whose *weakest* step
scores highest, min aggregation as in Lightman et al. 2023 and Math-Shepherd; `prm_aggregate`) and by
the ORM (its score at the final step), against majority voting and the oracle pass@n. Judges rerank too
(`judges`: `reward.judges` entries of kind `judge`, `megalign.roles.judge`): each sample's judge score, the
highest picked, beside the PRM and ORM. Each verifier's ranking AUC of right vs wrong fresh samples
(`ranking_auc`), over all of them and over the pairs of one prompt, says whether it ranks samples of unseen prompts
at all, and whether it ranks them where best-of-n needs it.

Design choices:

- Solutions are split into steps at `separator` ("\\n" for the arithmetic chains); a sample with an
  empty step cannot be a stepwise row and is dropped from the labels (counted), and is ranked last
  by the verifiers (it still counts in pass@n and voting).
- Each dp rank samples its share of the prompts (d, d + dp, ...) with its own generator seeded by
  (seed, dp rank); results are gathered to every rank in prompt order. tp = 1 (the tools run small
  policies; the PRM trainer itself runs at any tp).
- Correctness is `megalign.rewards.math_accuracy` against the gold answer (the last `\\boxed{}`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megalign.algos import IGNORE_INDEX, math_shepherd_labels
from megalign.config import atomic_write_text, option
from megalign.data import (ArithChain, ArithChainConfig, build_tokenizer, collate_stepwise, encode_steps,
                           make_chain_splits, write_jsonl)
from megalign.data.preference import encode_prompt
from megalign.data.tokenizer import Tokenizer, TokenizerConfig
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rewards.judge import JudgeTemplate, TemplateOnly
from megalign.rewards.math import extract_answer, math_accuracy, normalize_answer
from megalign.rewards.ranking import ranking_auc
from megalign.roles.judge import JudgeRewardConfig, judge_reward, load_judge
from megalign.roles.reward import step_probs
from megalign.roles.reward_exports import load_prm_info
from megalign.rollout.generate import SamplingParams, generate
from megalign.trainers.base import check_model_path
from megalign.trainers.evaluation import left_pad
from megalign.trainers.online_roles import OnlineRoles

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SamplingConfig:
    """How solutions are sampled from the policy."""

    temperature: float = option(1.0, doc="sampling temperature (> 0)")
    max_new_tokens: int = option(48, doc="longest solution, in tokens")
    batch_size: int = option(1024, doc="sequences decoded together")

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {self.max_new_tokens}, {self.batch_size}")


@dataclasses.dataclass
class PolicySamplesConfig:
    """What both tools share: the policy that samples, which prompts, how solutions are sampled and split."""

    policy: str = option("runs/sft_chain/hf", doc="HF folder of the policy that samples (e.g. an SFT export)")
    chain: ArithChainConfig = option(ArithChainConfig(), doc="the multi-step arithmetic task (label: its train split; best_of_n: its held-out split)")
    first_prompt: int = option(0, doc="start at this prompt of the split (e.g. past the prompts the policy was SFT-trained on)")
    num_prompts: int = option(0, doc="this many prompts from first_prompt; 0: all the rest")
    separator: str = option("\n", doc="the text between steps")
    sampling: SamplingConfig = option(SamplingConfig(), doc="sampling")
    tokenizer: TokenizerConfig = option(TokenizerConfig(), doc="tokenizer (default: the policy folder's own)")
    seed: int = option(0, doc="seed of the samples")
    device: str = option("auto", doc="auto, cpu or cuda")

    def __post_init__(self):
        if self.num_prompts < 0 or self.first_prompt < 0:
            raise ValueError(f"first_prompt and num_prompts must be >= 0, got {self.first_prompt}, {self.num_prompts}")

    def prompts(self, chains: Sequence[ArithChain]) -> list[ArithChain]:
        """The chosen prompts of a split; an error when none is left."""
        chosen = list(chains[self.first_prompt:self.first_prompt + self.num_prompts if self.num_prompts else None])
        if not chosen:
            raise ValueError(f"first_prompt={self.first_prompt} leaves no prompt of the {len(chains)} in the split")
        return chosen


@dataclasses.dataclass
class LabelStepsConfig(PolicySamplesConfig):
    """Monte-Carlo step labels from a policy's samples (`launch/prm_tools.py label --config ... key=value`)."""

    out: str = option("runs/prm_data/mc_steps.jsonl", doc="the stepwise rows written (JSONL)")
    samples: int = option(4, doc="solutions sampled per prompt")
    completions: int = option(8, doc="Monte-Carlo completions per step")
    labels: Literal["soft", "hard"] = option("soft", doc="soft: fraction reaching the answer; hard: any reaches it")

    def __post_init__(self):
        super().__post_init__()
        if self.samples < 1 or self.completions < 1:
            raise ValueError(f"samples and completions must be >= 1, got {self.samples}, {self.completions}")


@dataclasses.dataclass
class BestOfNConfig(PolicySamplesConfig):
    """Best-of-N reranking on held-out prompts (`launch/prm_tools.py best_of_n --config ... key=value`)."""

    prm: str = option("runs/prm_chain/hf", doc="the process reward model (a launch/train_prm.py export)")
    orm: Optional[str] = option("runs/orm_chain/hf", doc="an outcome reward model to compare with (algo.supervise: outcome); null: none")
    prm_aggregate: Literal["min", "prod", "last"] = option("min", doc="a solution's PRM score from its step scores")
    out: str = option("runs/best_of_n.json", doc="the results written (JSON)")
    n: int = option(16, doc="samples per prompt")
    judges: list[JudgeRewardConfig] = option([], doc="judges that rerank too, as reward.judges entries of kind judge "
                                                     "(template fields {prompt}, {response}, {reference}, [{criterion}])")

    def __post_init__(self):
        super().__post_init__()
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        names = [j.name for j in self.judges]
        taken = {"greedy", "vote", "pass", "sample_mean", "prm", "orm"} & set(names)
        if taken or len(set(names)) != len(names):
            raise ValueError(f"judges[].name must be unique and not one of the summary's keys, got {names}")
        for i, j in enumerate(self.judges):
            if j.kind != "judge":
                raise ValueError(f"judges[{i}].kind={j.kind!r}: the chain prompts carry no rubric; only kind judge")
            judge_reward(j, TemplateOnly(JudgeTemplate(j.judge.template, f"judges[{i}].judge.template")))


@dataclasses.dataclass
class ChainDataConfig:
    """The chains' SFT rows (`launch/prm_tools.py data`; the policy that samples is SFT-trained on them)."""

    out_dir: str = option("runs/prm_data", doc="folder of chain_train.jsonl (prompt / response / answer) and chain_held_out.jsonl")
    sft_prompts: int = option(0, doc="chain_train.jsonl holds the first N training chains; 0: all. Label the rest "
                                     "(label.first_prompt=N): samples of prompts the policy was trained on are almost all right")
    chain: ArithChainConfig = option(ArithChainConfig(), doc="the multi-step arithmetic task")
    device: str = option("auto", doc="auto, cpu or cuda (process group only)")


def write_chain_data(cfg: ChainDataConfig) -> tuple[str, str]:
    """Write the train and held-out chains as SFT / prompt rows (`megalign.data.write_jsonl`); returns the paths."""
    train, held_out = make_chain_splits(cfg.chain)
    train = train[:cfg.sft_prompts or None]
    paths = os.path.join(cfg.out_dir, "chain_train.jsonl"), os.path.join(cfg.out_dir, "chain_held_out.jsonl")
    if dist.get_rank() == 0:
        write_jsonl(train, paths[0])
        write_jsonl(held_out, paths[1])
        logger.info("wrote %d training and %d held-out chains to %s", len(train), len(held_out), cfg.out_dir)
    return paths


def split_steps(response: str, separator: str) -> Optional[list[str]]:
    """The steps of a response, or None when one would be empty (not a valid stepwise solution)."""
    steps = response.split(separator)
    return steps if all(steps) else None


def _layout(device: str) -> ParallelLayout:
    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    return ParallelLayout.build(tp=1, device_type=device_type)


def _load_policy(path: str, key: str, layout: ParallelLayout):
    check_model_path(path, key)
    model = from_pretrained(path, layout=layout)
    model.eval()
    return model


@torch.no_grad()
def continue_texts(model, tokenizer: Tokenizer, prefixes: Sequence[list[int]], params: SamplingParams,
                   generator: Optional[torch.Generator], layout: ParallelLayout, batch_size: int) -> list[str]:
    """The decoded continuation (special tokens dropped) of every token-id prefix, in order."""
    texts = []
    for start in range(0, len(prefixes), batch_size):
        ids, mask = left_pad(prefixes[start:start + batch_size], tokenizer.pad_id, layout.device)
        out = generate(model, ids, mask, params, generator)
        texts += [tokenizer.decode(row) for row in out.sequences[:, ids.shape[1]:].tolist()]
    return texts


def _gather(items: list, layout: ParallelLayout) -> list:
    """This rank's [(prompt index, item)] gathered over dp, sorted by prompt index."""
    parts = [None] * layout.dp
    dist.all_gather_object(parts, items, group=layout.dp_group)
    return [item for _, item in sorted((pair for part in parts for pair in part), key=lambda pair: pair[0])]


def _params(cfg: SamplingConfig, tokenizer: Tokenizer, temperature: Optional[float] = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature if temperature is None
                          else temperature, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)


def _step_ids(prompt_ids: list[int], steps: Sequence[str], tokenizer: Tokenizer, separator: str) -> list[int]:
    """Prompt + each step and its separator, encoded one by one as `megalign.data.stepwise` does."""
    return encode_steps(prompt_ids, steps, [0.0] * len(steps), tokenizer, separator).ids


def label_steps(cfg: LabelStepsConfig) -> dict:
    """Write Monte-Carlo-labelled stepwise rows for the training prompts (module doc); returns counts."""
    layout = _layout(cfg.device)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.policy)
    model = _load_policy(cfg.policy, "policy", layout)
    chains = cfg.prompts(make_chain_splits(cfg.chain)[0])
    mine = list(range(layout.dp_rank, len(chains), layout.dp))
    generator = torch.Generator(layout.device).manual_seed(cfg.seed * 1009 + layout.dp_rank)
    params = _params(cfg.sampling, tokenizer)
    prompt_ids = {i: encode_prompt(chains[i].prompt, tokenizer) for i in mine}
    jobs = [(i, prompt_ids[i]) for i in mine for _ in range(cfg.samples)]
    responses = continue_texts(model, tokenizer, [ids for _, ids in jobs], params, generator, layout,
                               cfg.sampling.batch_size)
    solutions, dropped = [], 0
    for (i, _), response in zip(jobs, responses):
        steps = split_steps(response, cfg.separator)
        if steps is None:
            dropped += 1
        else:
            solutions.append((i, steps))
    prefixes, owners = [], []
    for s, (i, steps) in enumerate(solutions):
        for k in range(len(steps) - 1):
            ids = _step_ids(prompt_ids[i], steps[:k + 1], tokenizer, cfg.separator)
            prefixes += [ids] * cfg.completions
            owners += [(s, k)] * cfg.completions
    completions = continue_texts(model, tokenizer, prefixes, params, generator, layout, cfg.sampling.batch_size)
    reached = {}
    for (s, k), text in zip(owners, completions):
        i, steps = solutions[s]
        done = cfg.separator.join(steps[:k + 1]) + cfg.separator + text
        reached.setdefault((s, k), []).append(math_accuracy(done, chains[i].answer) > 0.5)
    rows = []
    for s, (i, steps) in enumerate(solutions):
        labels = []
        if len(steps) > 1:
            table = torch.tensor([reached[(s, k)] for k in range(len(steps) - 1)], dtype=torch.bool)
            labels = math_shepherd_labels(table, cfg.labels).tolist()
        labels.append(float(math_accuracy(cfg.separator.join(steps), chains[i].answer) > 0.5))
        rows.append((i, {"prompt": chains[i].prompt, "completions": steps, "labels": labels,
                         "answer": chains[i].answer}))
    everything = _gather(rows, layout)
    counts = torch.tensor([dropped, len(jobs)], dtype=torch.float64, device=layout.device)
    dist.all_reduce(counts, group=layout.dp_group)
    summary = {"prompts": len(chains), "solutions": int(counts[1]), "dropped": int(counts[0]), "rows": len(everything),
               "correct_solutions": sum(r["labels"][-1] == 1.0 for r in everything),
               "mean_step_label": (sum(sum(r["labels"]) for r in everything) /
                                   max(sum(len(r["labels"]) for r in everything), 1))}
    if dist.get_rank() == 0:
        atomic_write_text(cfg.out, "".join(json.dumps(r) + "\n" for r in everything))
        logger.info("wrote %d stepwise rows to %s: %s", len(everything), cfg.out, summary)
    return summary


@torch.no_grad()
def verifier_scores(model, info: dict, tokenizer: Tokenizer, prompt_ids: Sequence[list[int]],
                    steps: Sequence[Optional[list[str]]], layout: ParallelLayout, batch_size: int,
                    aggregate: str) -> list[float]:
    """One score per solution: `aggregate` (min / prod / last) of the verifier's per-step p(correct);
    -inf for a solution without valid steps (None)."""
    token_ids = (info["negative_token_id"], info["positive_token_id"])
    scores = [float("-inf")] * len(steps)
    valid = [j for j, s in enumerate(steps) if s is not None]
    for start in range(0, len(valid), batch_size):
        chunk = valid[start:start + batch_size]
        examples = [encode_steps(prompt_ids[j], steps[j], [0.0] * len(steps[j]), tokenizer, info["separator"])
                    for j in chunk]
        batch = collate_stepwise(examples, tokenizer.pad_id)
        where = (batch["step_labels"] != IGNORE_INDEX).to(layout.device)
        probs = step_probs(model, batch["input_ids"].to(layout.device), batch["attention_mask"].to(layout.device),
                           where, token_ids).double().cpu()
        offset = 0
        for j, example in zip(chunk, examples):
            p = probs[offset:offset + len(example.step_positions)]
            offset += len(example.step_positions)
            scores[j] = float({"min": p.min(), "prod": p.prod(), "last": p[-1]}[aggregate])
    return scores


def _vote(responses: Sequence[str], answer) -> float:
    """1.0 when the most common extracted answer (ties: the first reached) is right."""
    extracted = [extract_answer(r) for r in responses]
    keys = [normalize_answer(a) for a in extracted if a is not None]
    if not keys:
        return 0.0
    top = Counter(keys).most_common(1)[0][0]
    return float(math_accuracy(f"\\boxed{{{top}}}", answer) > 0.5)


def best_of_n(cfg: BestOfNConfig) -> dict:
    """Greedy, majority vote, best-of-n by ORM and PRM, pass@n on the held-out prompts (module doc), and each
    verifier's ranking AUC of right vs wrong fresh samples, over all of them and within a prompt (`ranking_auc`)."""
    layout = _layout(cfg.device)
    for key in ("prm", "orm"):
        if getattr(cfg, key) is not None:
            check_model_path(getattr(cfg, key), key)
    for i, j in enumerate(cfg.judges):
        OnlineRoles.check_judge_folder(f"judges[{i}].judge", j.judge.path)
    tokenizer = build_tokenizer(cfg.tokenizer, cfg.policy)
    policy = _load_policy(cfg.policy, "policy", layout)
    chains = cfg.prompts(make_chain_splits(cfg.chain)[1])
    mine = list(range(layout.dp_rank, len(chains), layout.dp))
    generator = torch.Generator(layout.device).manual_seed(cfg.seed * 1009 + layout.dp_rank)
    prompt_ids = [encode_prompt(chains[i].prompt, tokenizer) for i in mine]
    greedy = continue_texts(policy, tokenizer, prompt_ids, _params(cfg.sampling, tokenizer, temperature=0.0), None,
                            layout, cfg.sampling.batch_size)
    samples = continue_texts(policy, tokenizer, [ids for ids in prompt_ids for _ in range(cfg.n)],
                             _params(cfg.sampling, tokenizer), generator, layout, cfg.sampling.batch_size)
    del policy
    flat_ids = [ids for ids in prompt_ids for _ in range(cfg.n)]
    flat_steps = [split_steps(r, cfg.separator) for r in samples]
    verifiers = {"prm": (cfg.prm, cfg.prm_aggregate)}
    if cfg.orm is not None:
        verifiers["orm"] = (cfg.orm, "last")
    scores = {}
    for name, (path, aggregate) in verifiers.items():
        info = load_prm_info(path)
        model = _load_policy(path, name, layout)
        scores[name] = verifier_scores(model, info, tokenizer, flat_ids, flat_steps, layout, cfg.sampling.batch_size,
                                       aggregate)
        del model
    for k, j in enumerate(cfg.judges):
        term = judge_reward(j, load_judge(j.name, j.judge, layout, f"judges[{k}].judge"))
        scores[j.name] = term([chains[i].prompt for i in mine for _ in range(cfg.n)], samples,
                              [chains[i].answer for i in mine for _ in range(cfg.n)])
    results, mine_right = [], []  # this rank's samples: right or not, in sample order
    for r, i in enumerate(mine):
        group = samples[r * cfg.n:(r + 1) * cfg.n]
        right = [math_accuracy(s, chains[i].answer) > 0.5 for s in group]
        mine_right += right
        row = {"greedy": float(math_accuracy(greedy[r], chains[i].answer) > 0.5), "vote": _vote(group, chains[i].answer),
               "pass": float(any(right)), "sample_mean": sum(right) / cfg.n}
        for name, values in scores.items():
            mine_scores = values[r * cfg.n:(r + 1) * cfg.n]
            row[name] = float(right[max(range(cfg.n), key=lambda j: (mine_scores[j], -j))])
        results.append((i, row))
    rows = _gather(results, layout)
    summary = {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}
    summary.update(prompts=len(rows), n=cfg.n, prm_aggregate=cfg.prm_aggregate, judges=[j.name for j in cfg.judges])
    scored = _gather([(0, (scores, mine_right))], layout)  # every rank's samples: the AUCs are over all of them
    right_all = [y for _, part in scored for y in part]
    for key, group in (("auc", None), ("auc_within_prompt", cfg.n)):
        summary[key] = {name: ranking_auc([float(v) for part, _ in scored for v in part[name]], right_all, group)
                        for name in scores}
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
        atomic_write_text(cfg.out, json.dumps(summary, indent=1) + "\n")
        print(best_of_n_table(summary), flush=True)
    return summary


def best_of_n_table(summary: dict) -> str:
    """The closing table: each selection rule's held-out accuracy, then the PRM's change over greedy."""
    n = summary["n"]
    lines = [("greedy", summary["greedy"]), (f"sample (mean of {n})", summary["sample_mean"]),
             (f"majority vote of {n}", summary["vote"])]
    if "orm" in summary:
        lines.append((f"best-of-{n}, outcome RM", summary["orm"]))
    lines += [(f"best-of-{n}, judge {name}", summary[name]) for name in summary.get("judges", [])]
    lines += [(f"best-of-{n}, process RM ({summary['prm_aggregate']} step)", summary["prm"]),
              (f"pass@{n} (oracle)", summary["pass"])]
    width = max(len(name) for name, _ in lines + [("change", 0)])
    out = [f"held-out accuracy ({summary['prompts']} prompts)"] + [f"  {name:<{width}}  {value:6.1%}"
                                                                  for name, value in lines]
    for key, pairs in (("auc", "all samples"), ("auc_within_prompt", "within a prompt")):
        aucs = [f"{name} {'-' if auc is None else f'{auc:.3f}'}" for name, auc in summary.get(key, {}).items()]
        if aucs:
            out.append(f"  ranking AUC, right vs wrong, {pairs}: {', '.join(aucs)}")
    out.append(f"  {'change':<{width}}  {(summary['prm'] - summary['greedy']) * 100:+.1f} points")
    return "\n".join(out)
