"""Is PPO's critic right? Its values and GAE's targets against Monte-Carlo returns of the same prefixes.

    python benchmarks/ppo_critic_check.py --policy RUN/hf --critic RUN/critic_hf [--prompts 32 --k 4 --m 16]

For each of `--prompts` arithmetic prompts (the training split PPO samples from, or `--split held_out`) the
policy samples one response; for `--k` prefixes of it (response positions t spread evenly over its valid
tokens, t = 0 being the prompt alone) the policy samples `--m` continuations of prompt + response[:t], and
the verifier's mean reward over them is the Monte-Carlo return of that state (gamma = 1, reward at the end:
G_t = E[R | s_t], Sutton & Barto ch. 5). Compared at those positions, over all prompts:

    value      the critic's V(s_t) (`megalign.roles.critic.response_values`: the value before token t)
    return     GAE's return target R_t = A_t + V_t (`megalign.algos.ppo`, with --lam, the sampled reward)
    advantage  GAE's A_t against the Monte-Carlo advantage R - G_t (the advantage a perfect critic would
               give at lam = 1 for the sampled response)

Printed: Pearson correlation, mean error (estimate - G) and mean absolute error for each, and the same by
prefix position (early prefixes: the critic must predict the answer's correctness from the prompt).
A critic whose value correlates with G no better than a constant (the batch's mean reward) explains
nothing: the explained variance 1 - Var(G - V) / Var(G) is printed too. One CPU process; about a minute at
the defaults for the tiny embedded model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.algos.ppo import advantages_and_returns, token_rewards  # noqa: E402
from megalign.data.arith import ArithTaskConfig, make_splits  # noqa: E402
from megalign.data.preference import encode_prompt  # noqa: E402
from megalign.data.tokenizer import TokenizerConfig, build_tokenizer  # noqa: E402
from megalign.models import from_pretrained, scalar_head_from_pretrained  # noqa: E402
from megalign.parallel import ParallelLayout  # noqa: E402
from megalign.rewards.math import math_accuracy  # noqa: E402
from megalign.roles.critic import response_values  # noqa: E402
from megalign.rollout.generate import SamplingParams, generate  # noqa: E402
from megalign.trainers.evaluation import left_pad  # noqa: E402


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two [n] float64 vectors; nan when either is constant."""
    x, y = x - x.mean(), y - y.mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return float((x * y).sum() / denom) if denom > 0 else float("nan")


def compare(estimate: torch.Tensor, target: torch.Tensor) -> dict:
    """Correlation, mean error (estimate - target), mean |error| and explained variance of `target` by `estimate`."""
    error = estimate - target
    var = target.var(unbiased=False)
    return {"corr": pearson(estimate, target), "mean_error": float(error.mean()), "mae": float(error.abs().mean()),
            "explained_var": float(1 - error.var(unbiased=False) / var) if var > 0 else float("nan")}


def prefix_positions(length: int, k: int) -> list[int]:
    """Up to k distinct response positions in [0, length): 0 (the prompt alone) first, the last valid token last."""
    if length <= k:
        return list(range(length))
    return sorted({round(i * (length - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", required=True, help="the policy's HF export (a PPO run's hf/ or the SFT export)")
    parser.add_argument("--critic", required=True, help="the critic's HF export (a PPO run's critic_hf/)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--k", type=int, default=4, help="prefixes per response")
    parser.add_argument("--m", type=int, default=16, help="Monte-Carlo continuations per prefix")
    parser.add_argument("--lam", type=float, default=1.0, help="GAE lambda of the targets compared")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="rollout.max_response_length of the run")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--split", choices=("train", "held_out"), default="train")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    for name in ("prompts", "k", "m", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='critic-check-')}", rank=0,
                            world_size=1)
    layout = ParallelLayout.build(tp=1, device_type="cpu")
    tokenizer = build_tokenizer(TokenizerConfig(), args.policy)
    policy = from_pretrained(args.policy, layout=layout).eval()
    critic, fresh = scalar_head_from_pretrained(args.critic, "value", layout, args.seed)
    if fresh:
        raise SystemExit(f"--critic {args.critic!r} has no value head (score.weight): give a PPO run's critic_hf")
    critic.eval()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    generator = torch.Generator().manual_seed(args.seed)

    train, held_out = make_splits(ArithTaskConfig())
    problems = (train if args.split == "train" else held_out)[:args.prompts]
    prompt_ids = [encode_prompt(p.prompt, tokenizer) for p in problems]
    ids, mask = left_pad(prompt_ids, tokenizer.pad_id, layout.device)
    out = generate(policy, ids, mask, params, generator)
    R = out.sequences.shape[1] - ids.shape[1]
    response_mask = out.attention_mask[:, ids.shape[1]:].float()
    responses = out.sequences[:, ids.shape[1]:].tolist()
    rewards = torch.tensor([math_accuracy(tokenizer.decode(r), p.answer) for r, p in zip(responses, problems)])

    values = response_values(critic, out.sequences, out.attention_mask, R)
    token_r, _ = token_rewards(rewards, response_mask)
    advantages, returns = advantages_and_returns(token_r, values, response_mask, 1.0, args.lam)

    jobs = []  # (row, position)
    for row in range(len(problems)):
        jobs += [(row, t) for t in prefix_positions(int(response_mask[row].sum()), args.k)]
    mc = torch.zeros(len(jobs), dtype=torch.float64)
    for t in sorted({t for _, t in jobs}):  # a prefix of t tokens keeps the rollout's budget: max_new_tokens - t
        mine = [j for j, (_, tj) in enumerate(jobs) if tj == t]
        prefixes = [prompt_ids[jobs[j][0]] + responses[jobs[j][0]][:t] for j in mine for _ in range(args.m)]
        tail_params = dataclasses.replace(params, max_new_tokens=args.max_new_tokens - t)
        for start in range(0, len(prefixes), 256):
            p_ids, p_mask = left_pad(prefixes[start:start + 256], tokenizer.pad_id, layout.device)
            tails = generate(policy, p_ids, p_mask, tail_params, generator).sequences[:, p_ids.shape[1]:].tolist()
            for i, tail in enumerate(tails, start):
                j = mine[i // args.m]
                row = jobs[j][0]
                mc[j] += math_accuracy(tokenizer.decode(responses[row][:t] + tail), problems[row].answer) / args.m

    rows = torch.tensor([r for r, _ in jobs])
    cols = torch.tensor([t for _, t in jobs])
    at = {"value": values[rows, cols].double(), "return": returns[rows, cols].double()}
    mc_advantage = rewards[rows].double() - mc
    summary = {"policy": args.policy, "critic": args.critic, "prompts": len(problems), "k": args.k, "m": args.m,
               "lam": args.lam, "split": args.split, "positions": len(jobs),
               "sample_reward_mean": float(rewards.mean()), "mc_return_mean": float(mc.mean()),
               "value_vs_mc": compare(at["value"], mc), "gae_return_vs_mc": compare(at["return"], mc),
               "gae_advantage_vs_mc_advantage": compare(advantages[rows, cols].double(), mc_advantage),
               "by_prefix": {}}
    order = torch.stack([torch.tensor(prefix_positions(int(response_mask[r].sum()), args.k).index(int(t)))
                         for r, t in zip(rows, cols)])
    for rank in range(args.k):
        sel = order == rank
        if sel.sum() > 1:
            summary["by_prefix"][rank] = {"n": int(sel.sum()), "mc_mean": float(mc[sel].mean()),
                                          "value_vs_mc": compare(at["value"][sel], mc[sel])}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
