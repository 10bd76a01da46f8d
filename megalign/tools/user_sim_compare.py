"""The `user_sim` demonstration's before/after table (issue 28): the simulated user's mean final score (e_T / 100,
the GRPO reward) of the SFT policy and of GRPO from it on held-out dialogues, with the share of well-formed
replies, ending with `change  +N.N points` (score x 100, after minus before) and `ratio  N.NNx` (after / before).

Design choices:

- The headline numbers are the policies' expected scores: `samples` episodes per held-out row at temperature 1
  (the distribution GRPO optimises), drawn by `multiturn_rollout` from the engine's per-sample streams (a fixed
  `seed`, so the table is reproducible); one greedy episode per row is reported beside them. Issue 28's targets
  read the sampled numbers: mean final score after GRPO >= 2x the SFT policy's, >= 90% of replies well-formed.
- Episodes run exactly as GRPO runs them: the environment, its keyword arguments, the limits on turns, turn
  tokens and episode tokens and the stop strings are read from the GRPO run's config (`config`, default
  examples/grpo_user_sim.yaml), not repeated here. An episode whose environment raised scores 0.
- Per policy: mean score, well-formed replies (the user's `format_ok` count over all policy turns), solved
  dialogues (the user got the right total), premature answers per dialogue, and turns per dialogue.
- Runs as one process or under torchrun: rows split over ranks (every dp-th), sums all-reduced.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Literal

import torch
import torch.distributed as dist

from megalign.config import atomic_write_text, option
from megalign.data import build_tokenizer
from megalign.data.tokenizer import TokenizerConfig
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.parallel.collectives import all_reduce
from megalign.rollout import SamplingParams, multiturn_rollout
from megalign.trainers.model_checks import check_model_path
from megalign.trainers.run_config import resolve_device

SUMS = ("score", "well_formed", "turns", "solved", "premature", "episodes")


@dataclasses.dataclass
class UserSimCompareConfig:
    """The two policies, the held-out rows and the episode limits (module doc; defaults: run_embedded.sh user_sim)."""

    before: str = option("runs/sft_user_sim/hf", doc="HF folder of the SFT on the user-sim traces")
    after: str = option("runs/grpo_user_sim/hf", doc="HF folder of GRPO against the simulated user from it")
    prompts: str = option("runs/user_sim_data/user_sim_held_out.jsonl", doc="held-out rows (numbers, op, answer)")
    max_samples: int = option(200, doc="the first N held-out rows")
    samples: int = option(4, doc="sampled episodes per row at temperature 1 (the headline numbers)")
    seed: int = option(0, doc="seed of the sampled episodes")
    config: str = option("examples/grpo_user_sim.yaml", doc="the GRPO run's config: the environment (rollout.env: "
                                                          "ArithmeticUser's kwargs, max_turns, max_turn_tokens) and "
                                                          "rollout.max_response_length the episodes run with")
    summary_path: str = option("", doc="also write the numbers as JSON here; empty: no file")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")

    def __post_init__(self):
        for key in ("max_samples", "samples"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


def held_out_rows(path: str, limit: int) -> list[dict]:
    """The first `limit` rows of the held-out file; ValueError naming the file and line of a row that is not JSON
    or lacks `numbers` (the environment's reset would otherwise fail every episode of it)."""
    from megalign.data.prompts import read_rows

    rows = []
    for where, row in read_rows(path, "held-out dialogues"):
        if len(rows) == limit:
            break
        if isinstance(row, ValueError) or not isinstance(row, dict) or "numbers" not in row:
            raise ValueError(f"{where}: expected a JSON row with 'numbers' (launch/user_sim.py data writes them), "
                             f"got {row!r}")
        rows.append(row)
    return rows


def episode_sums(episodes) -> list[float]:
    """The `SUMS` of a list of ArithmeticUser episodes: score, well-formed replies, policy turns, solved dialogues,
    premature answers, episodes (an episode whose environment raised scores 0 and counts no well-formed reply)."""
    out = [0.0] * len(SUMS)
    for e in episodes:
        failed = e.end == "error"
        for i, value in enumerate((0.0 if failed else e.reward, 0 if failed else e.info.get("format_ok", 0),
                                   len(e.action_ranges), e.info.get("solved", 0), e.info.get("premature_answers", 0),
                                   1)):
            out[i] += float(value)
    return out


def policy_numbers(sums: list[float]) -> dict[str, float]:
    """Means of `episode_sums` (summed over ranks): per episode, and well-formed replies per policy turn."""
    s = dict(zip(SUMS, sums))
    n = max(s["episodes"], 1.0)
    return {"score": s["score"] / n, "well_formed": s["well_formed"] / max(s["turns"], 1.0), "solved": s["solved"] / n,
            "premature_per_dialogue": s["premature"] / n, "turns_per_dialogue": s["turns"] / n,
            "episodes": s["episodes"]}


def comparison_lines(results: dict[str, dict[str, dict[str, float]]], samples: int) -> list[str]:
    """The table (sampled and greedy rows per policy), then `change  +N.N points` and `ratio  N.NNx` of the
    sampled mean scores (after vs before)."""
    names = {"before": "SFT (impatient traces)", "after": "GRPO against the user"}
    width = max(len(n) for n in names.values())
    lines = ["simulated user, held-out dialogues: mean final score e_T/100, well-formed replies, solved, premature "
             "answers per dialogue"]
    for key, name in names.items():
        for mode, label in (("sampled", f"T=1 x{samples}"), ("greedy", "greedy")):
            r = results[key][mode]
            lines.append(f"  {name:<{width}}  {label:<8}  score {r['score']:.3f}  well-formed {r['well_formed']:6.1%}  "
                         f"solved {r['solved']:6.1%}  premature {r['premature_per_dialogue']:.2f}")
    before, after = results["before"]["sampled"]["score"], results["after"]["sampled"]["score"]
    ratio = f"{after / before:.2f}x" if before > 0 else "inf (SFT scores 0)"
    return lines + [f"change  {100 * (after - before):+.1f} points", f"ratio  {ratio}"]


def compare_user_sim(cfg: UserSimCompareConfig) -> dict[str, dict[str, dict[str, float]]]:
    """Evaluate both policies (module doc), print `comparison_lines` on rank 0 and return the numbers."""
    from megalign.config import load_config
    from megalign.envs.base import env_factory
    from megalign.trainers.grpo import GRPOConfig

    for key in ("before", "after"):
        check_model_path(getattr(cfg, key), key)
    run = load_config(GRPOConfig, cfg.config)
    env = run.rollout.env
    if env is None:
        raise ValueError(f"config={cfg.config!r} has no rollout.env: the comparison runs its environment's episodes")
    factory = env_factory(env.name, env.kwargs)
    layout = ParallelLayout.build(tp=1, device_type=resolve_device(cfg.device))
    tokenizer = build_tokenizer(TokenizerConfig(kind="auto"), cfg.before)
    rows = held_out_rows(cfg.prompts, cfg.max_samples)
    mine = rows[layout.dp_rank::layout.dp]
    keys = [layout.dp_rank + layout.dp * i for i in range(len(mine))]  # the row's index: same streams at any dp
    limits = env.multiturn(run.rollout.max_response_length)
    results: dict = {}
    for key in ("before", "after"):
        model = from_pretrained(getattr(cfg, key), layout=layout).eval()
        results[key] = {}
        for mode, group, temperature in (("sampled", cfg.samples, 1.0), ("greedy", 1, 0.0)):
            params = SamplingParams(max_new_tokens=env.max_turn_tokens or run.rollout.max_response_length,
                                    temperature=temperature,
                                    eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
            sums = [0.0] * len(SUMS)
            if mine:
                with torch.no_grad():
                    episodes, _ = multiturn_rollout(model, tokenizer, factory, mine, group, params, cfg.seed, limits,
                                                    prompt_keys=keys)
                sums = episode_sums(episodes)
            total = all_reduce(torch.tensor(sums, dtype=torch.float64, device=layout.device), layout.dp_group)
            results[key][mode] = policy_numbers(total.cpu().tolist())
    if dist.get_rank() == 0:
        print("\n".join(comparison_lines(results, cfg.samples)), flush=True)
        if cfg.summary_path:
            atomic_write_text(cfg.summary_path, json.dumps(results, indent=1) + "\n")
    return results
