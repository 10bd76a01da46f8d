"""GAE and group advantages: megalign kernels vs the peers' Python loops, side by side.

- gae at B=32, T=4096 (fp32, masks with leading/trailing padding and holes) vs the reversed Python
  loop over t of TRL / DeepSpeed-Chat / verl (verl's multi-turn form, which carries the state across
  masked tokens), and megalign's own torch.where reference loop.
- group_advantages (grpo) at N=16384 with uneven groups given by uid vs verl's per-group dictionary
  loop (defaultdict of scores per uid, mean/std per uid, then a loop over samples) and a vectorised
  torch version (megalign's index_add / scatter_reduce reference, torch.unique for the ids). Two
  uid layouts: scattered (each sample an independent uid draw) and in runs (a prompt's samples
  next to each other, as verl's repeat(interleave=True) lays them out), and contiguous groups of
  16 (group_size). megalign and the torch version run in alternating blocks of calls (see
  median_times_blocked), warm, and for the scattered case also with the caches flushed before
  every call, as between the other ops of a training step.

Targets: gae >= 30x and group_advantages >= 20x faster than the Python loops (issue 2);
group_advantages >= 10x faster than the vectorised torch version (issue 8).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import Row, format_table, machine_line, median_time  # noqa: E402

from megalign.ops import _backend  # noqa: E402
from megalign.ops.gae import gae  # noqa: E402
from megalign.ops.group_advantages import group_advantages  # noqa: E402
from megalign.ops.reference.gae import gae as reference_gae  # noqa: E402
from megalign.ops.reference.group_advantages import group_advantages as reference_group_advantages  # noqa: E402


def gae_python_loop(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return (multi-turn form): the reversed loop over t."""
    mask = mask.to(rewards.dtype)
    nextvalues, lastgaelam, reversed_adv = 0.0, 0.0, []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        reversed_adv.append(lastgaelam)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def grpo_dict_loop(scores, index, eps=1e-6):
    """verl's compute_grpo_outcome_advantage: a dictionary of scores per uid and Python loops."""
    scores = scores.clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(group)
            id2mean[idx], id2std[idx] = torch.mean(stacked), torch.std(stacked)
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + eps)
    return scores


def _gae_inputs(B, T):
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    t = torch.arange(T)
    start = torch.randint(0, T // 8, (B, 1), generator=g)
    end = T - torch.randint(0, T // 4, (B, 1), generator=g)
    holes = (t % 97 >= 80)  # tool-output spans inside the response
    return rewards, values, (t >= start) & (t < end) & ~holes


def bench_gae(B, T, repeats):
    r, v, m = _gae_inputs(B, T)
    case = f"B={B} T={T} fp32"
    ours, peer = gae(r, v, m, 0.99, 0.95)[0], gae_python_loop(r, v, m, 0.99, 0.95)[0]
    torch.testing.assert_close(ours[m], peer[m], atol=1e-4, rtol=1e-4)  # same numbers at valid tokens
    run = lambda f: median_time(lambda: f(r, v, m, 0.99, 0.95), repeats=repeats)  # noqa: E731
    return [Row("gae", case, "megalign", run(gae)),
            Row("gae", case, "verl/TRL reversed loop", run(gae_python_loop)),
            Row("gae", case, "megalign reference (where loop)", run(reference_gae))]


def median_times_blocked(fns, blocks, calls, before=lambda: None):
    """Median seconds of each fn over `blocks` rounds in which every fn runs `calls` times in a row
    (a a a b b b a a a ...), the first call of each block untimed; `before()` runs, untimed, ahead of
    every call. A change in the machine's load hits each fn alike, and one fn's memory traffic does
    not leave the next fn's caches cold (call by call interleaving measured megalign's ~0.1 ms op
    at up to twice its time right after the torch version's ~1.5 ms)."""
    times = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            for k in range(calls + 1):
                before()
                t0 = time.perf_counter()
                fn()
                if k:
                    times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_group(N, repeats):
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (N,), generator=g).float() + 0.1 * torch.randn(N, generator=g)
    uid = torch.randint(0, N // 8, (N,), generator=g) * 7919  # uneven groups, sparse ids
    index = [str(u) for u in uid.tolist()]  # verl keeps uids as strings in a numpy array
    case = f"N={N} uneven ({torch.unique(uid).numel()} groups) grpo"
    _, dense, count = torch.unique(uid, return_inverse=True, return_counts=True)
    shared = count[dense] > 1  # verl maps a lone sample to score / (1 + eps), megalign to 0
    torch.testing.assert_close(group_advantages(scores, group_index=uid)[shared],
                               grpo_dict_loop(scores, index)[shared], atol=1e-5, rtol=1e-5)
    runs = uid.sort().values  # the same groups, each prompt's samples next to each other
    cases = {case: dict(group_index=uid), f"N={N} uneven, uid in runs, grpo": dict(group_index=runs),
             f"N={N} contiguous groups of 16, grpo": dict(group_size=16)}
    rows = []
    for name, grouping in cases.items():
        torch.testing.assert_close(group_advantages(scores, **grouping), reference_group_advantages(scores, **grouping))
        fns = {"megalign": lambda: group_advantages(scores, **grouping),
               "torch vectorised (index_add)": lambda: reference_group_advantages(scores, **grouping)}
        t = median_times_blocked(fns, blocks=repeats, calls=10)
        rows += [Row("group_advantages", name, impl, seconds) for impl, seconds in t.items()]
        if name == case:
            rows.append(Row("group_advantages", case, "verl uid dictionary loop",
                            median_time(lambda: grpo_dict_loop(scores, index), repeats=max(1, repeats // 3))))
            junk = torch.empty(16 << 20)  # 64 MiB, twice the last-level cache here
            t = median_times_blocked(fns, blocks=repeats, calls=10, before=lambda: junk.fill_(1.0))
            rows += [Row("group_advantages", f"{case}, cold caches", impl, seconds) for impl, seconds in t.items()]
    return rows


def run(quick: bool = False) -> list[Row]:
    if not _backend.use_kernels(torch.empty(0)):
        raise RuntimeError("bench_advantages measures the megalign kernels: build megalign._C first")
    if quick:
        return bench_gae(4, 256, 3) + bench_group(1024, 2)
    return bench_gae(32, 4096, 9) + bench_group(16384, 10)


if __name__ == "__main__":
    print(machine_line())
    print(format_table(run(quick="--quick" in sys.argv)))
