"""The embedded MoE run's own steps (`launch/run_embedded.sh moe`, issue 30): its from-scratch start and its table.

- `write_scratch_moe` (`python launch/moe_run.py init out=runs/moe_init`): a tiny Qwen3-MoE from scratch as an HF
  folder. The trainers build only dense models from scratch (`model.path: null`, `megalign.trainers.scratch`), and
  expert parallelism needs the MoE model from a folder (`model.ep` checks its experts before it loads).
- `summarize_moe_run` (`python launch/moe_run.py summary ...`): held-out accuracy before / after each GRPO run and
  its rollout / trainer log-prob mismatch, from the runs' `metrics.jsonl`.

Design choices:
- The dense part is a from-scratch policy's (`PolicyModelConfig`'s fields, `scratch_config`, over the character
  tokenizer, Qwen3's attention) with every SwiGLU replaced by `num_experts` experts of width
  `moe_intermediate_size`, `experts_per_token` of them per token, renormalised (`norm_topk_prob`). A dense
  control of the same active parameter count is the from-scratch Qwen3 with `model.intermediate_size` =
  experts_per_token * moe_intermediate_size (the router's H * E weights per layer aside).
- Initialised as the trainers' scratch models are (every matrix, the router and the stacked experts included,
  drawn from N(0, init_std) by a generator seeded with `seed`; norm gains 1), in one process, so the folder does
  not depend on the layout the run then uses.
- The folder holds `config.json`, `model.safetensors` (`save_hf_checkpoint`) and the character tokenizer's files,
  which `transformers` loads and the trainers take as `model.path` / `actor.path`.
- The table's "before" is the SFT run's last held-out accuracy (the GRPO run's initial model, on the same held-out
  split: both read `data.arith` alike), "after" the GRPO run's last; the mismatch columns are the means over the
  run's steps of `rollout/logprob_max_abs_diff`, `rollout/logprob_k3` and `rollout/logprob_bitwise_equal`
  (`megalign.rollout.mismatch`), and `moe/router_agreement` where the run logs it (replay off).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch

from megalign.config import option
from megalign.data import CharTokenizer
from megalign.models import CausalLM, save_hf_checkpoint
from megalign.trainers.scratch import scratch_config
from megalign.trainers.supervised import PolicyModelConfig


@dataclasses.dataclass
class ScratchMoEConfig:
    """Where to write the folder and the model's shape (module doc)."""

    out: str = option("runs/moe_init", doc="folder to write (created; existing files are overwritten)")
    model: PolicyModelConfig = option(PolicyModelConfig(model_type="qwen3"),
                                      doc="the dense fields (width, layers, heads, init_std); intermediate_size unused")
    num_experts: int = option(8, doc="experts per MoE layer E (every layer is an MoE layer)")
    experts_per_token: int = option(2, doc="experts each token is routed to, k")
    moe_intermediate_size: int = option(192, doc="SwiGLU width of one expert")
    seed: int = option(0, doc="seed of the initialisation")
    device: str = option("cpu", doc="the launch's process group (the folder is written on the host either way)")

    def __post_init__(self):
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token must be in [1, num_experts={self.num_experts}], got "
                             f"{self.experts_per_token}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")


def write_scratch_moe(cfg: ScratchMoEConfig) -> str:
    """Write the folder of `cfg` (module doc); returns its path."""
    tokenizer = CharTokenizer()
    config = dataclasses.replace(scratch_config(cfg.model, tokenizer), model_type="qwen3_moe",
                                 num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                                 moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=True)
    model = CausalLM(config)
    generator = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, cfg.model.init_std, generator=generator)
    os.makedirs(cfg.out, exist_ok=True)
    save_hf_checkpoint(model, cfg.out)
    tokenizer.save(cfg.out)
    return cfg.out


@dataclasses.dataclass
class MoERunSummaryConfig:
    """The runs to tabulate (module doc): each `name=run_dir` of `grpo` paired with its SFT run."""

    sft: dict[str, str] = option({}, doc="SFT run folders by name, e.g. {moe: runs/sft_moe_arith}")
    grpo: dict[str, str] = option({}, doc="GRPO run folders by name, e.g. {moe_replay: runs/grpo_moe_replay}")
    start: dict[str, str] = option({}, doc="which SFT run (a key of sft) each GRPO run started from")
    summary_path: Optional[str] = option(None, doc="also write the table as JSON here")
    device: str = option("cpu", doc="the launch's process group (the table is read on the host)")

    def __post_init__(self):
        for name in self.grpo:
            if self.start.get(name) not in self.sft:
                raise ValueError(f"start.{name}: name the SFT run (one of {sorted(self.sft)}) GRPO run {name} started from")


MISMATCH = ("rollout/logprob_max_abs_diff", "rollout/logprob_k3", "rollout/logprob_bitwise_equal", "moe/router_agreement")


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _last_eval(run_dir: str) -> float:
    evals = [row["eval/accuracy"] for row in _rows(run_dir) if "eval/accuracy" in row]
    if not evals:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no eval/accuracy (was eval.max_samples 0?)")
    return evals[-1]


def summarize_moe_run(cfg: MoERunSummaryConfig) -> dict[str, dict[str, float]]:
    """{GRPO run: {before, after, gain (points), steps, mean of each mismatch metric logged}}; printed as a table."""
    table = {}
    for name, run_dir in cfg.grpo.items():
        rows = [row for row in _rows(run_dir) if "rollout/logprob_k3" in row]
        before, after = _last_eval(cfg.sft[cfg.start[name]]), _last_eval(run_dir)
        entry = {"before": before, "after": after, "gain": 100 * (after - before), "steps": len(rows)}
        for key in MISMATCH:
            values = [row[key] for row in rows if key in row]
            if values:
                entry[key] = sum(values) / len(values)
        table[name] = entry
    print(f"{'run':<20} {'before':>7} {'after':>7} {'gain':>7}  mismatch (means over steps)")
    for name, e in table.items():
        extra = "  ".join(f"{k.split('/')[-1]}={e[k]:.3g}" for k in MISMATCH if k in e)
        print(f"{name:<20} {e['before']:>7.1%} {e['after']:>7.1%} {e['gain']:>+7.1f}  {extra}")
    if cfg.summary_path:
        with open(cfg.summary_path, "w") as f:
            json.dump(table, f, indent=1)
    return table
