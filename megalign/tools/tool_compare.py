"""The `tools` demonstration's before/after table (issue 28): held-out accuracy of the policies trained with the
calculator (greedy episodes against `ToolEnv`) and without it (greedy single responses), ending with
`change  +N.N points` = GRPO with tools minus GRPO without, at the same budget.

Design choices:

- The tool policies are evaluated as GRPO evaluates them (`EpisodeRollout.evaluate`): one greedy episode per
  held-out prompt through `multiturn_rollout` with the same environment (ToolEnv, calculator only, not described
  in the prompt), the same limits (turns, turn tokens, episode tokens = max_response_length + 1) and no stop
  string (`megalign.data.tool_traces`: turns end at eos, as the SFT traces do); `math_accuracy` (builtin) scores
  the last policy turn, an episode whose environment raised scores 0.
- The policies without tools are evaluated like every other embedded pipeline: `evaluate_generation` (greedy,
  `max_new_tokens` tokens) on the same prompt rows.
- Tool use per policy: the fraction of episodes that called the tool (`env/share/tool_calls`' definition) and of
  those whose every call parsed and ran (tool_calls > 0 and no tool_errors: "called correctly").
- Runs as one process or under torchrun: prompts split over ranks (every dp-th), counts summed.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Literal

import torch
import torch.distributed as dist

from megalign.config import atomic_write_text, option
from megalign.data import build_tokenizer, load_prompts
from megalign.data.tokenizer import TokenizerConfig
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.parallel.collectives import all_reduce
from megalign.rollout import SamplingParams, multiturn_rollout
from megalign.rollout.multiturn import MultiTurnConfig
from megalign.trainers.episodes import last_turn_text
from megalign.trainers.evaluation import EvalConfig, evaluate_generation
from megalign.trainers.model_checks import check_model_path
from megalign.trainers.run_config import resolve_device


@dataclasses.dataclass
class ToolCompareConfig:
    """The four policies, the held-out prompts and the episode limits (module doc; defaults: run_embedded.sh tools)."""

    tools_before: str = option("runs/sft_tools_arith/hf", doc="HF folder of the SFT on tool traces")
    tools_after: str = option("runs/grpo_tools_arith/hf", doc="HF folder of GRPO with tools from it")
    plain_before: str = option("runs/sft_plain_arith/hf", doc="HF folder of the plain SFT (direct answers)")
    plain_after: str = option("runs/grpo_no_tools_arith/hf", doc="HF folder of GRPO without tools (the control)")
    prompts: str = option("runs/tool_traces/arith_held_out.jsonl", doc="held-out prompt rows (prompt, answer)")
    max_samples: int = option(200, doc="the first N held-out prompts (GRPO's eval.max_samples)")
    max_response_length: int = option(160, doc="tokens of an episode after its first (GRPO's rollout.max_response_length)")
    max_turn_tokens: int = option(96, doc="tokens per policy turn (rollout.env.max_turn_tokens)")
    max_turns: int = option(3, doc="policy turns per episode (rollout.env.max_turns)")
    max_calls_per_turn: int = option(2, doc="ToolEnv's max_calls_per_turn")
    max_new_tokens: int = option(16, doc="greedy tokens of a response without tools")
    summary_path: str = option("", doc="also write the numbers as JSON here; empty: no file")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")

    def __post_init__(self):
        for key in ("max_samples", "max_response_length", "max_turn_tokens", "max_turns", "max_calls_per_turn",
                    "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


def tool_episode_scores(model, tokenizer, examples, cfg: ToolCompareConfig) -> list[tuple[float, bool, bool]]:
    """(math_accuracy of the last turn, called the tool, every call ran) of one greedy ToolEnv episode per example."""
    import functools

    from megalign.data.tool_traces import answer_reward
    from megalign.envs.tool_env import ToolEnv

    factory = functools.partial(ToolEnv, describe_tools=False, max_calls_per_turn=cfg.max_calls_per_turn)
    params = SamplingParams(max_new_tokens=cfg.max_turn_tokens, temperature=0.0, eos_token_id=tokenizer.eos_id,
                            pad_token_id=tokenizer.pad_id)
    limits = MultiTurnConfig(max_turns=cfg.max_turns, max_total_tokens=cfg.max_response_length + 1)
    rows = [{"prompt": e.prompt_text, "answer": e.answer} for e in examples]
    with torch.no_grad():
        episodes, _ = multiturn_rollout(model, tokenizer, factory, rows, 1, params, 0, limits)
    out = []
    for e, row in zip(episodes, rows):
        right = 0.0 if e.end == "error" else answer_reward(row["prompt"], last_turn_text(tokenizer, e), row["answer"], {})
        calls = e.info.get("tool_calls", 0) > 0
        out.append((right, calls, calls and e.info.get("tool_errors", 0) == 0))
    return out


def comparison_lines(results: dict[str, dict[str, float]]) -> list[str]:
    """The table: each policy's accuracy (and tool use for the tool runs), each GRPO run's gain over its SFT, and
    last `change  +N.N points` = GRPO with tools minus GRPO without (points of held-out accuracy)."""
    names = {"tools_before": "SFT on tool traces, with tools", "tools_after": "GRPO with tools",
             "plain_before": "plain SFT, no tools", "plain_after": "GRPO without tools (control)"}
    gains = {"tools_after": "tools_before", "plain_after": "plain_before"}
    width = max(len(n) for n in names.values())
    lines = ["held-out accuracy (greedy)"]
    for key, name in names.items():
        r = results[key]
        text = f"  {name:<{width}}  {r['accuracy']:6.1%}"
        if key in gains:
            text += f"  ({100 * (r['accuracy'] - results[gains[key]]['accuracy']):+.1f} points)"
        if "tool_called" in r:
            text += f"  called the tool {r['tool_called']:.1%}, correctly {r['tool_correct']:.1%}"
        lines.append(text)
    change = 100 * (results["tools_after"]["accuracy"] - results["plain_after"]["accuracy"])
    return lines + [f"change  {change:+.1f} points"]


def compare_tools(cfg: ToolCompareConfig) -> dict[str, dict[str, float]]:
    """Evaluate the four policies (module doc), print `comparison_lines` on rank 0 and return the numbers."""
    keys = ("tools_before", "tools_after", "plain_before", "plain_after")
    for key in keys:
        check_model_path(getattr(cfg, key), key)
    layout = ParallelLayout.build(tp=1, device_type=resolve_device(cfg.device))
    tokenizer = build_tokenizer(TokenizerConfig(kind="auto"), cfg.tools_before)
    examples = list(load_prompts(cfg.prompts, tokenizer, 64))[:cfg.max_samples]
    mine = examples[layout.dp_rank::layout.dp]
    results = {}
    for key in keys:
        model = from_pretrained(getattr(cfg, key), layout=layout).eval()
        if key.startswith("plain"):
            accuracy = evaluate_generation(model, examples, tokenizer, EvalConfig(), cfg.max_new_tokens, layout)[0]
            results[key] = {"accuracy": float(accuracy)}
            continue
        scores = tool_episode_scores(model, tokenizer, mine, cfg) if mine else []
        sums = torch.tensor([sum(s[i] for s in scores) for i in range(3)] + [len(scores)], dtype=torch.float64)
        sums = all_reduce(sums.to(layout.device), layout.dp_group).cpu().tolist()
        n = max(sums[3], 1.0)
        results[key] = {"accuracy": sums[0] / n, "tool_called": sums[1] / n, "tool_correct": sums[2] / n}
    if dist.get_rank() == 0:
        print("\n".join(comparison_lines(results)), flush=True)
        if cfg.summary_path:
            atomic_write_text(cfg.summary_path, json.dumps(results, indent=1) + "\n")
    return results
