"""Held-out evaluation by greedy generation, shared by every trainer that generates (SFT, GRPO, ...).

Design choices:

- The score of a response is a reward function from `megalign.rewards` chosen by name in the config
  (`eval.metric`, default `math_accuracy`; a user `module:function` spec works too), so a task with
  its own verifier evaluates with it; the reported `eval/accuracy` is its mean over the held-out
  prompts and is meant for scores in [0, 1].
- The examples are split over dp ranks (rank d takes d, d + dp, ...); the tp ranks of a dp rank decode
  the same prompts together. Sums are reduced over dp, so every rank returns the same value.
- Expert parallelism (ep > 1): the ranks of an ep group hold different examples, maybe a different number of
  generation batches; they agree on the most batches and a rank out of batches idles through the others'
  (`megalign.rollout.generate.ExpertLockstep`), so every MoE forward's all-to-all finds the whole group.
  Pipelined generation (pp > 1) is not lock-stepped and is refused at ep > 1.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from megalign.config import option
from megalign.data import PromptExample, Tokenizer
from megalign.parallel import ParallelLayout
from megalign.parallel.collectives import all_reduce
from megalign.rewards import get_reward
from megalign.rollout.generate import ExpertLockstep, SamplingParams, generate, pipeline_generate


@dataclasses.dataclass
class EvalConfig:
    """Held-out evaluation: greedy responses to the held-out prompts, scored by a reward function."""

    every: int = option(0, doc="evaluate every N steps during training (0: only at the end, and before training for RL)")
    max_samples: Optional[int] = option(None, doc="evaluate the first N held-out prompts; null: all; 0: no evaluation")
    batch_size: int = option(128, doc="prompts per generation batch on each dp rank")
    max_new_tokens: Optional[int] = option(None, doc="generation length limit; null: the trainer's response length")
    metric: str = option("math_accuracy", doc="reward function that scores a response in [0, 1] (a registered name or 'module:function')")

    def __post_init__(self):
        if self.every < 0 or (self.max_samples is not None and self.max_samples < 0):
            raise ValueError(f"every and max_samples must be >= 0, got {self.every}, {self.max_samples}")
        if self.batch_size < 1 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {self.batch_size}, {self.max_new_tokens}")
        get_reward(self.metric)  # an unknown name fails at config load, not after training


def eval_count(cfg: EvalConfig, examples: Optional[Sequence[PromptExample]]) -> int:
    """How many held-out prompts an evaluation scores (0: no evaluation)."""
    n = len(examples) if examples else 0
    return n if cfg.max_samples is None else min(cfg.max_samples, n)


@torch.no_grad()
def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(`input_ids`, `attention_mask`) [B, P] of B prompts padded on the left, as `generate` takes them (every
    row's next token lands in the same column)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate_responses(model, examples: Sequence[PromptExample], tokenizer: Tokenizer, params: SamplingParams,
                       device, generator: Optional[torch.Generator] = None,
                       layout: Optional[ParallelLayout] = None) -> tuple[list[str], list[bool]]:
    """(decoded responses, whether each ended with EOS) of one generation batch of `examples`' prompts
    (`left_pad`ded); `model` is this rank's (tp shard of the) `CausalLM`, in whatever mode the caller set,
    or its pipeline stage when `layout.pp > 1` (`pipeline_generate`: every rank of the pp group passes the
    same prompts and gets the same responses). At ep > 1 every rank of the ep group calls it, each with its own
    examples (`generate` keeps them in lock step)."""
    ids, mask = left_pad([e.prompt_ids for e in examples], tokenizer.pad_id, device)
    if layout is not None and layout.pp > 1:
        layout.refuse_expert_parallel("pipelined held-out generation (pp > 1)")
        out = pipeline_generate(model, ids, mask, params, layout, generator)
    else:
        out = generate(model, ids, mask, params, generator)
    rows = out.sequences[:, ids.shape[1]:].tolist()
    return [tokenizer.decode(row) for row in rows], [tokenizer.eos_id in row for row in rows]


@torch.no_grad()
def evaluate_generation(model, examples: Sequence[PromptExample], tokenizer: Tokenizer, cfg: EvalConfig,
                        max_new_tokens: int, layout: ParallelLayout) -> tuple[float, list[tuple[str, str, Any]]]:
    """(mean `cfg.metric` score over the held-out prompts, a few (prompt, response, answer) samples).

    `model`: this rank's (tp shard of the) `CausalLM`; `max_new_tokens` applies when
    `cfg.max_new_tokens` is null. Collective over `layout.dp_group` (module doc).
    """
    metric = get_reward(cfg.metric)
    mine = list(examples[layout.dp_rank:eval_count(cfg, examples):layout.dp])
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens or max_new_tokens, temperature=0.0,
                            eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    score, samples = 0.0, []
    was_training = model.training
    model.eval()
    if layout.pp > 1:  # before the agreement below: a rank out of batches would idle through a pipeline stage
        layout.refuse_expert_parallel("pipelined held-out generation (pp > 1)")
    lockstep = ExpertLockstep(model, layout.device)
    starts = range(0, len(mine), cfg.batch_size)
    for _ in range(lockstep.agree(len(starts)) - len(starts)):  # the ep group's other ranks have more batches
        lockstep.drain()
    for start in starts:
        chunk = mine[start:start + cfg.batch_size]
        responses, _ = generate_responses(model, chunk, tokenizer, params, layout.device, layout=layout)
        score += sum(metric([e.prompt_text for e in chunk], responses, [e.answer for e in chunk],
                            [e.metadata for e in chunk]))
        samples += [(e.prompt_text, r, e.answer) for e, r in zip(chunk, responses)][:5 - len(samples)]
    model.train(was_training)
    counts = all_reduce(torch.tensor([score, len(mine)], dtype=torch.float64, device=layout.device), layout.dp_group)
    return float(counts[0] / counts[1].clamp(min=1)), samples
