"""Held-out evaluation by greedy generation, shared by every trainer that generates (SFT, GRPO, ...).

Design choices:

- The score of a response is a reward function from `megalign.rewards` chosen by name in the config
  (`eval.metric`, default `math_accuracy`; a user `module:function` spec works too), so a task with
  its own verifier evaluates with it; the reported `eval/accuracy` is its mean over the held-out
  prompts and is meant for scores in [0, 1].
- The examples are split over dp ranks (rank d takes d, d + dp, ...); the tp ranks of a dp rank decode
  the same prompts together. Sums are reduced over dp, so every rank returns the same value.
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
from megalign.rollout.generate import SamplingParams, generate


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
    for start in range(0, len(mine), cfg.batch_size):
        chunk = mine[start:start + cfg.batch_size]
        width = max(len(e.prompt_ids) for e in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, e in enumerate(chunk):  # left padding: every row's next token lands in the same column
            ids[i, width - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            mask[i, width - len(e.prompt_ids):] = 1
        out = generate(model, ids.to(layout.device), mask.to(layout.device), params)
        responses = [tokenizer.decode(row) for row in out.sequences[:, width:].tolist()]
        score += sum(metric([e.prompt_text for e in chunk], responses, [e.answer for e in chunk],
                            [e.metadata for e in chunk]))
        samples += [(e.prompt_text, r, e.answer) for e, r in zip(chunk, responses)][:5 - len(samples)]
    model.train(was_training)
    counts = all_reduce(torch.tensor([score, len(mine)], dtype=torch.float64, device=layout.device), layout.dp_group)
    return float(counts[0] / counts[1].clamp(min=1)), samples
