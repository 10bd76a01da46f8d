"""Does a reward model pick right answers? Best-of-n by its score on a policy's samples, against the verifier.

    python benchmarks/rm_best_of_n.py --rm RUN/hf --rows SAMPLES/unpaired.jsonl [--n 1 4 8 16 64]

`--rows` is a `launch/sample_pairs.py` file of unpaired rows (`prompt`, `completion`, `label`: the verifier's
verdict), all of one prompt's samples from one policy; give fresh samples (another `seed=`) to score an RM on data
it did not train on. For each n, each prompt's first n samples (sample order, so every n reads the same draws) are
reranked by the RM and the top one's verdict counts; printed beside the mean verdict (best-of-1's expectation) and
pass@n (a perfect reranker's), and the within-prompt ranking AUC (`megalign.rewards.ranking`: the fraction of one
prompt's (right, wrong) sample pairs the RM orders right, ties half, duplicates counted as sampled).

What it shows (Gao et al. 2022, "Scaling laws for reward model overoptimization"): the n at which best-of-n by a
learned RM stops rising and falls, where its top scores go to the wrong answers it over-scores. PPO optimises the
same score, past any n, so an RM whose best-of-n falls at n = 16 is hacked by PPO within a round. One process;
the RM is the trainer's own `RewardModel` (`scalar_head_from_pretrained`), scoring prompt + completion + EOS as
`launch/train_rm.py` encodes a string pair.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalign.data.preference import load_unpaired  # noqa: E402
from megalign.data.prompts import DataError  # noqa: E402
from megalign.data.tokenizer import TokenizerConfig, build_tokenizer  # noqa: E402
from megalign.models import scalar_head_from_pretrained  # noqa: E402
from megalign.parallel import ParallelLayout  # noqa: E402
from megalign.rewards.ranking import ranking_pairs  # noqa: E402


def read_groups(path: str, tokenizer, max_length: int) -> dict[tuple, list[tuple[list[int], bool]]]:
    """prompt ids -> [(prompt + completion ids, verdict)] in row order, read and checked by the KTO loader
    (`megalign.data.preference.load_unpaired`: a bad row is an error naming the file and row)."""
    try:
        examples, _ = load_unpaired(path, tokenizer, max_length)
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from None
    groups = defaultdict(list)
    for e in examples:
        groups[tuple(e.prompt_ids)].append((e.prompt_ids + e.completion_ids, e.label))
    if not groups:
        raise SystemExit(f"error: {path}: no rows")
    return groups


@torch.no_grad()
def rm_scores(rm, groups: dict, batch_size: int) -> dict[tuple, list[float]]:
    """prompt -> the RM's score of each of its samples, in the rows' order (sequences of one length batched)."""
    scores = {prompt: [0.0] * len(samples) for prompt, samples in groups.items()}
    by_length = defaultdict(list)
    for prompt, samples in groups.items():
        for k, (ids, _) in enumerate(samples):
            by_length[len(ids)].append((prompt, k, ids))
    for items in by_length.values():
        for start in range(0, len(items), batch_size):
            chunk = items[start:start + batch_size]
            ids = torch.tensor([ids for _, _, ids in chunk])
            for (prompt, k, _), score in zip(chunk, rm(ids, torch.ones_like(ids)).float().tolist()):
                scores[prompt][k] = score
    return scores


def best_of_n(groups: dict, scores: dict, ns: list[int]) -> list[dict]:
    """Per n: best-of-n by the RM, mean verdict and pass@n over the prompts with at least n samples."""
    out = []
    for n in ns:
        picked, mean, passed, prompts = 0.0, 0.0, 0.0, 0
        for prompt, samples in groups.items():
            if len(samples) < n:
                continue
            labels, values = [y for _, y in samples[:n]], scores[prompt][:n]
            picked += labels[max(range(n), key=lambda j: (values[j], -j))]
            mean, passed, prompts = mean + sum(labels) / n, passed + any(labels), prompts + 1
        if prompts:
            out.append({"n": n, "prompts": prompts, "best_of_n": picked / prompts, "mean": mean / prompts,
                        "pass_at_n": passed / prompts})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rm", required=True, help="the reward model's HF export (a train_rm run's hf/)")
    parser.add_argument("--rows", required=True, help="unpaired rows of one policy's samples (sample_pairs' out_dir)")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    if min(args.n) < 1:
        raise SystemExit(f"error: --n must be >= 1, got {min(args.n)}")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    layout = ParallelLayout.build(tp=1, device_type="cpu")
    rm, fresh = scalar_head_from_pretrained(args.rm, "reward", layout, seed=0)
    if fresh:
        raise SystemExit(f"error: --rm {args.rm!r} has no reward head (score.weight): give a train_rm run's hf/")
    groups = read_groups(args.rows, build_tokenizer(TokenizerConfig(), args.rm), rm.config.max_position_embeddings)
    scores = rm_scores(rm.eval(), groups, args.batch_size)
    u, pairs = 0.0, 0
    for prompt, samples in groups.items():
        part_u, part_pairs = ranking_pairs(scores[prompt], [y for _, y in samples])
        u, pairs = u + part_u, pairs + part_pairs
    summary = {"rm": args.rm, "rows": args.rows, "prompts": len(groups),
               "auc_within_prompt": u / pairs if pairs else None, "best_of_n": best_of_n(groups, scores, args.n)}
    print(f"{len(groups)} prompts; within-prompt AUC {summary['auc_within_prompt']:.3f}" if pairs else
          f"{len(groups)} prompts; no prompt has both a right and a wrong sample")
    print("| n | prompts | best-of-n by the RM | mean verdict | pass@n |\n|---:|---:|---:|---:|---:|")
    for row in summary["best_of_n"]:
        print(f"| {row['n']} | {row['prompts']} | {row['best_of_n']:.3f} | {row['mean']:.3f} | {row['pass_at_n']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
