"""Preference pairs from a policy's own samples, labelled by a verifier: the reward-model data of the
classic SFT -> RM -> PPO pipeline without a human in the loop (`sample_pairs(cfg)`).

For every prompt the policy (e.g. the SFT export) samples `samples_per_prompt` responses at the
given temperature; the verifier (`metric`, default `math_accuracy`) scores each; a prompt with both
a passing (score >= `threshold`) and a failing finished response yields up to `pairs_per_prompt`
pairs (chosen passing, rejected failing, drawn without repeats from the seed). Rows are TRL's
explicit-prompt format (`prompt`, `chosen`, `rejected`, `answer`), which `launch/train_rm.py` and
`launch/train_dpo.py` read with `data.path=` / `data.eval_path=`. The same samples also give KTO's
unpaired rows (TRL's `prompt`, `completion`, `label`, `answer`; `unpaired_rows`): every usable sample
once, label = the verifier's verdict, so KTO (Ethayarajh et al. 2024) and DPO can be compared on one
set of on-policy samples. This is RLAIF's idea (Bai et al. 2022; Lee et al. 2023) with
a rule verifier as the labeller, and it gives the RM the policy's own distribution of responses,
which a reward model trained on hand-made pairs has never seen (and PPO then exploits; see
BENCHMARKS.md).

Design choices:

- Responses cut at `max_new_tokens` (no EOS) are left out (`drop_unfinished`): the RM data appends
  EOS to every reply, and a truncated response has no answer to verify.
- Prompts are split over the dp ranks (rank d takes d, d + dp, ...), each rank samples with a
  generator seeded by (seed, rank); rank 0 gathers the rows and writes both files atomically
  (`megalign.config.atomic_write_text`), the training and the held-out split each from its own prompts.
- `unpaired_prompts=paired` keeps KTO to the prompts DPO's pairs come from (a passing and a failing sample):
  a prompt whose samples all fail gives only undesirable rows, which push its whole distribution down with
  nothing to move the mass to (the prompts GRPO's group advantage leaves out as well); measured in
  BENCHMARKS.md, "KTO on the SFT model's own samples".
- The unpaired rows keep repeats (a response sampled 5 times is 5 rows): they are the policy's own
  distribution, which is what KTO's on-policy setting asks for. Rank 0 shuffles them with the seed before
  writing, because the KTO trainer pairs row i with row i + 1's completion for its reference point z0
  (`megalign.trainers.kto`) and unshuffled rows i and i + 1 mostly share a prompt.
- The counts (prompts, responses, finished, usable passing ones, prompts with a pair, pairs, desirable and
  undesirable unpaired rows) are logged and returned; KTO's weights follow from desirable / undesirable
  (`megalign.algos.kto.kto_weight_ratio`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from typing import Any, Literal

import torch
import torch.distributed as dist

from megalign.config import atomic_write_text, option
from megalign.data import PromptExample, build_tokenizer
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rewards import get_reward
from megalign.rollout.generate import SamplingParams
from megalign.trainers.evaluation import generate_responses
from megalign.trainers.model_checks import check_model_path
from megalign.trainers.online_config import PromptDataConfig, prompt_datasets
from megalign.trainers.run_config import resolve_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SelfPairsConfig:
    """Where the policy and the prompts come from, how many samples and pairs, where the rows go."""

    model_path: str = option("runs/sft_arith/hf", doc="HF checkpoint folder of the policy that samples")
    out_dir: str = option("runs/self_pairs", doc="folder for pairs.jsonl / unpaired.jsonl (training prompts) and pairs_held_out.jsonl / unpaired_held_out.jsonl")
    data: PromptDataConfig = option(PromptDataConfig(), doc="prompts with answers (the arithmetic task by default)")
    samples_per_prompt: int = option(8, doc="responses sampled per prompt")
    pairs_per_prompt: int = option(2, doc="pairs kept per prompt at most")
    temperature: float = option(1.0, doc="sampling temperature (> 0)")
    max_new_tokens: int = option(16, doc="generated tokens per response at most")
    batch_size: int = option(256, doc="responses per generation batch on each rank")
    metric: str = option("math_accuracy", doc="verifier that labels a response (registered name or 'module:function')")
    threshold: float = option(1.0, doc="a response passes when its score is >= threshold")
    drop_unfinished: bool = option(True, doc="leave out responses cut at max_new_tokens (no EOS)")
    unpaired_prompts: Literal["all", "paired"] = option(
        "all", doc="whose samples become KTO rows: every prompt's, or only those of prompts that yield a pair (as DPO's data)")
    seed: int = option(0, doc="seed of sampling and pair selection")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")

    def __post_init__(self):
        for name in ("samples_per_prompt", "pairs_per_prompt", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError(f"samples_per_prompt must be >= 2 to compare responses, got {self.samples_per_prompt}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        get_reward(self.metric)


def pairs_of(example: PromptExample, responses: list[str], usable: list[bool], scores: list[float],
             threshold: float, limit: int, rng: random.Random) -> list[dict[str, Any]]:
    """Up to `limit` rows (chosen passing, rejected failing) from one prompt's usable, non-empty, scored
    samples, each distinct text once."""
    passing = sorted({r for r, u, s in zip(responses, usable, scores) if u and r and s >= threshold})
    failing = sorted({r for r, u, s in zip(responses, usable, scores) if u and r and s < threshold})
    combos = [(c, r) for c in passing for r in failing]
    rng.shuffle(combos)
    return [{"prompt": example.prompt_text, "chosen": c, "rejected": r, "answer": example.answer}
            for c, r in combos[:limit]]


def unpaired_rows(example: PromptExample, responses: list[str], usable: list[bool], scores: list[float],
                  threshold: float) -> list[dict[str, Any]]:
    """One KTO row per usable, non-empty sample of one prompt, repeats kept: label True (desirable) when its score
    is >= threshold."""
    return [{"prompt": example.prompt_text, "completion": r, "label": s >= threshold, "answer": example.answer}
            for r, u, s in zip(responses, usable, scores) if u and r]


def _rows(cfg: SelfPairsConfig, model, examples: list[PromptExample], tokenizer, layout: ParallelLayout,
          split: str) -> tuple[list[dict], list[dict], dict[str, int]]:
    """This rank's pair rows, unpaired rows and counts for its share of `examples`."""
    metric = get_reward(cfg.metric)
    mine = examples[layout.dp_rank::layout.dp]
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                            eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    generator = torch.Generator(device=layout.device).manual_seed(cfg.seed * 1000003 + layout.dp_rank)
    rng = random.Random(f"{cfg.seed}/{split}/{layout.dp_rank}")
    k = cfg.samples_per_prompt
    per_batch = max(1, cfg.batch_size // k)
    rows, unpaired = [], []
    counts = {"prompts": 0, "responses": 0, "finished": 0, "passing": 0, "paired_prompts": 0}
    for start in range(0, len(mine), per_batch):
        chunk = mine[start:start + per_batch]
        repeated = [e for e in chunk for _ in range(k)]
        texts, finished = generate_responses(model, repeated, tokenizer, params, layout.device, generator)
        usable = finished if cfg.drop_unfinished else [True] * len(finished)
        scores = [float(s) for s in metric([e.prompt_text for e in repeated], texts, [e.answer for e in repeated],
                                           [e.metadata for e in repeated])]
        for i, e in enumerate(chunk):
            part = slice(i * k, (i + 1) * k)
            found = pairs_of(e, texts[part], usable[part], scores[part], cfg.threshold, cfg.pairs_per_prompt, rng)
            rows += found
            counts["paired_prompts"] += bool(found)
            if found or cfg.unpaired_prompts == "all":
                unpaired += unpaired_rows(e, texts[part], usable[part], scores[part], cfg.threshold)
        counts["prompts"] += len(chunk)
        counts["responses"] += len(repeated)
        counts["finished"] += sum(finished)
        counts["passing"] += sum(u and s >= cfg.threshold for u, s in zip(usable, scores))
    return rows, unpaired, counts


def sample_pairs(cfg: SelfPairsConfig) -> dict[str, dict[str, int]]:
    """Write out_dir/pairs.jsonl, unpaired.jsonl and their *_held_out.jsonl (module doc); returns {split: counts}.
    Every rank calls it."""
    check_model_path(cfg.model_path, "model_path")
    layout = ParallelLayout.build(tp=1, device_type=resolve_device(cfg.device))
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model_path)
    train, held_out = prompt_datasets(cfg.data, tokenizer, cfg.out_dir)
    model = from_pretrained(cfg.model_path, layout=layout).eval()
    report = {}
    for split, dataset, suffix in (("train", train, ""), ("held_out", held_out, "_held_out")):
        if dataset is None:
            continue
        gathered = [None] * layout.dp
        dist.all_gather_object(gathered, _rows(cfg, model, dataset.examples, tokenizer, layout, split))
        rows = [r for part, _, _ in gathered for r in part]
        unpaired = [r for _, part, _ in gathered for r in part]
        random.Random(f"{cfg.seed}/{split}/unpaired").shuffle(unpaired)  # module doc: z0's mismatched pairs
        counts = {key: sum(c[key] for _, _, c in gathered) for key in gathered[0][2]}
        counts["pairs"] = len(rows)
        counts["desirable"] = sum(r["label"] for r in unpaired)
        counts["undesirable"] = len(unpaired) - counts["desirable"]
        if dist.get_rank() == 0:
            for name, written in ((f"pairs{suffix}.jsonl", rows), (f"unpaired{suffix}.jsonl", unpaired)):
                atomic_write_text(os.path.join(cfg.out_dir, name), "".join(json.dumps(r) + "\n" for r in written))
        logger.info("%s: %s", split, counts)
        report[split] = counts
    dist.barrier()
    return report
