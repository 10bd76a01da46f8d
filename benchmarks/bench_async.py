"""Asynchronous GRPO on disaggregated ranks against the synchronous colocated run (issue 29), side by side in one
invocation, and the schedule simulation (`megalign.plan.schedule`) checked against what was measured.

    python benchmarks/bench_async.py --policy runs/sft_arith/hf [--steps 60] [--root /tmp/bench_async]
        [--repeats 1] [--nproc 2] [key=value ...]
    python benchmarks/bench_async.py --cluster-only

It first prints the simulation's prediction for a 64-device cluster (`cluster_table`: a 7B dense model, costs
assumed from H100 peak figures, long-tailed lengths): colocated against disaggregated placements at k = 0, 1, 2.

Runs `launch/train_grpo.py --config examples/grpo_arith.yaml` from the same SFT start, same seed and steps, under
torchrun on `--nproc` processes in three placements: colocated (dp = nproc, synchronous), disaggregated with one
rollout process at k = 0 and at k = 1 (the others train); with `--repeats` > 1 the three are interleaved. Extra
`key=value` overrides go to every run (e.g. rollout.max_response_length=64 rollout.temperature=1.3 for a longer
tail). Reports per run: seconds per step (mean `time/step` after the first step), generated samples per second, the
trained samples, and the held-out accuracy at the end (equal training samples: same steps x prompts x G, whole
groups kept by dynamic sampling); the ratios against colocated; and the simulation's prediction of each run's step
time from costs fitted on the k = 0 run (its rollout process generates the whole batch, its training process
trains on all of it) and the colocated run (each process half of it: the two batch sizes separate the latency and
the throughput terms; the weight broadcast's cost is the k = 0 run's `time/publish_weights`), with the relative
error; k = 1 is the prediction out of sample. A JSON summary goes to ROOT/summary.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megalign.plan.schedule import Costs, Placement, fit_costs, simulate  # noqa: E402

RUNS = {"colocated": [], "disaggregated k=0": ["placement.mode=disaggregated", "placement.max_staleness=0"],
        "disaggregated k=1": ["placement.mode=disaggregated", "placement.max_staleness=1"]}
TRAIN_PHASES = ("time/update", "time/old_logprobs", "time/reference")


def run(name: str, args, overrides: list[str], repeat: int) -> str:
    run_dir = os.path.join(args.root, f"{name.replace(' ', '_').replace('=', '')}_{repeat}")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
            os.path.join(ROOT, "launch", "train_grpo.py"), "--config", os.path.join(ROOT, "examples", "grpo_arith.yaml"),
            f"run_dir={run_dir}", f"actor.path={args.policy}", f"steps={args.steps}", "eval.every=0", "save_every=0",
            "export_hf=false", "resume=none", "overwrite_checkpoints=true", *RUNS[name], *overrides]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    start, load = time.perf_counter(), os.getloadavg()[0]
    with open(run_dir + ".log", "w") as log:
        subprocess.run(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    print(f"{name} (repeat {repeat}): {time.perf_counter() - start:.0f} s, 1-minute load {load:.2f} before and "
          f"{os.getloadavg()[0]:.2f} after (other jobs on the cores slow the runs unevenly)", flush=True)
    return run_dir


def read(run_dir: str) -> tuple[list[dict], float]:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "time/step" in r]
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r][-1]
    return steps, accuracy


def summarise(steps: list[dict], cfg: dict) -> dict[str, float]:
    group, prompts = cfg["group"], cfg["prompts"]
    timed = steps[1:]  # the first step pays start-up (and, disaggregated, the rollout side's first batch)
    wall = sum(r["time/step"] for r in timed)
    generated = sum(r["sampling/rounds"] * prompts * group for r in timed)
    return {"step_s": wall / len(timed), "median_step_s": statistics.median(r["time/step"] for r in timed),
            "samples_per_s": generated / wall,
            "trained_samples": sum(r["sampling/kept_groups"] * group for r in steps)}


def synthetic_lengths(row: dict, responses: int) -> np.ndarray:
    """Lengths with a step's mean and its longest response (`rollout/decode_steps` over the sampling rounds: the
    simulation generates a step as one batch, whose decode steps are the rounds' together)."""
    longest = row["rollout/decode_steps"]
    rest = (row["response_length/mean"] * responses - longest) / max(responses - 1, 1)
    return np.array([longest] + [rest] * (responses - 1))


def cost_rows(steps: list[dict], cfg: dict, devices: int) -> list[dict]:
    """`fit_costs` rows of one device of a run whose every side has `devices` devices (colocated dp 2: a half of
    each step's responses; disaggregated 1 + 1: all of them); sampling = generation + reward."""
    out = []
    for r in steps[1:]:
        responses = r["sampling/rounds"] * cfg["prompts"] * cfg["group"] / devices
        trained = r["sampling/kept_groups"] * cfg["group"] / devices
        out.append({"decode_steps": r["rollout/decode_steps"], "tokens": r["response_length/mean"] * responses,
                    "generate_s": r["time/generate"] + r.get("time/reward", 0.0),
                    "train_tokens": trained * (cfg["prompt_tokens"] + r["response_length/mean"]),
                    "train_s": sum(r.get(p, 0.0) for p in TRAIN_PHASES)})
    return out


def predict(name: str, costs: Costs, steps: list[dict], cfg: dict, nproc: int) -> float:
    """The simulated seconds per step of run `name`, on the lengths its own steps had."""
    group = cfg["group"]
    lengths = [synthetic_lengths(r, int(r["sampling/rounds"] * cfg["prompts"] * group)) for r in steps[1:]]
    kept = [step[:int(r["sampling/kept_groups"]) * group] for step, r in zip(lengths, steps[1:])]
    placement = (Placement("colocated", nproc) if name == "colocated" else
                 Placement("disaggregated", nproc, 1, k=int(name[-1])))
    return simulate(placement, costs, lengths, group, cfg["prompt_tokens"], kept)["step_s"]


CLUSTER_COSTS = Costs(
    decode_step_s=14e9 / 3.35e12,  # a decode step reads the 7B model's bf16 weights once: 14 GB at H100's 3.35 TB/s
    token_s=2 * 7e9 / (989e12 * 0.5),  # 2 x params FLOPs a generated token at 50% of bf16 peak
    train_token_s=(6 + 2) * 7e9 / (989e12 * 0.4),  # forward + backward (6N) and the old log-probs (2N) at 40%
    sync_s=14e9 / 50e9)  # the bf16 weights over 400 Gb/s (50 GB/s) to the rollout devices


def cluster_table(steps: int = 50, prompts: int = 512, group: int = 8, prompt_tokens: float = 200.0,
                  seed: int = 0) -> list[dict]:
    """Predicted seconds per step, samples/s and idle fraction on 64 devices for a 7B dense model (`CLUSTER_COSTS`,
    stated assumptions, not measurements) with long-tailed response lengths (log-normal, median 500 tokens,
    sigma 1, capped at 8192): colocated against disaggregated 48 + 16 and 32 + 32 at k = 0, 1, 2."""
    rng = np.random.default_rng(seed)
    lengths = [np.minimum(rng.lognormal(np.log(500), 1.0, prompts * group).round() + 1, 8192) for _ in range(steps)]
    layouts = [("colocated 64", Placement("colocated", 64))]
    layouts += [(f"{64 - r} train + {r} rollout, k={k}", Placement("disaggregated", 64, r, k=k))
                for r in (16, 32) for k in (0, 1, 2)]
    rows = []
    for name, placement in layouts:
        out = simulate(placement, CLUSTER_COSTS, lengths, group, prompt_tokens)
        rows.append({"placement": name, **out})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--root", default="/tmp/bench_async")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=float, default=10.0, help="mean prompt tokens (arith: about 10)")
    parser.add_argument("--cluster-only", action="store_true", help="print the 64-device predictions only")
    args, overrides = parser.parse_known_args()
    print("predicted on 64 devices (7B dense, costs assumed from H100 peak figures, not measured):")
    print(f"{'placement':<28} {'s/step':>7} {'samples/s':>10} {'idle':>6}")
    for row in cluster_table():
        print(f"{row['placement']:<28} {row['step_s']:7.1f} {row['samples_per_s']:10.1f} {row['idle_fraction']:6.1%}")
    if args.cluster_only:
        return
    if not args.policy:
        parser.error("--policy is required (an SFT export, e.g. runs/sft_arith/hf from launch/run_embedded.sh)")
    os.makedirs(args.root, exist_ok=True)
    cfg = {"group": 8, "prompts": 64, "prompt_tokens": args.prompt_tokens}
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "rollout.group_size":
            cfg["group"] = int(value)
        if key == "rollout.prompts_per_step":
            cfg["prompts"] = int(value)
    results: dict[str, list] = {name: [] for name in RUNS}
    for repeat in range(args.repeats):
        for name in RUNS:
            steps, accuracy = read(run(name, args, overrides, repeat))
            results[name].append((steps, accuracy))
    costs = fit_costs([row for name, devices in (("colocated", args.nproc), ("disaggregated k=0", 1))
                       for steps, _ in results[name] for row in cost_rows(steps, cfg, devices)])
    publish = [r.get("time/publish_weights", 0.0) for steps, _ in results["disaggregated k=0"] for r in steps[1:-1]]
    costs = dataclasses.replace(costs, sync_s=statistics.mean(publish))
    print(f"\ncosts fitted on the colocated and k=0 runs (k=1 is the prediction out of sample): {costs}")
    summary = {}
    base = None
    print(f"\n{'run':<20} {'s/step':>7} {'median':>7} {'samples/s':>10} {'x coloc':>8} {'trained':>8} {'held-out':>9} "
          f"{'predicted s/step':>17} {'error':>7}")
    for name, runs in results.items():
        stats = [summarise(steps, cfg) for steps, _ in runs]
        row = {key: statistics.mean(s[key] for s in stats) for key in stats[0]}
        row["accuracy"] = statistics.mean(a for _, a in runs)
        row["predicted_step_s"] = statistics.mean(predict(name, costs, steps, cfg, args.nproc) for steps, _ in runs)
        base = base or row
        row["speedup"] = row["samples_per_s"] / base["samples_per_s"]
        row["prediction_error"] = row["predicted_step_s"] / row["step_s"] - 1
        summary[name] = row
        print(f"{name:<20} {row['step_s']:7.3f} {row['median_step_s']:7.3f} {row['samples_per_s']:10.1f} {row['speedup']:8.2f} "
              f"{row['trained_samples']:8.0f} {100 * row['accuracy']:8.1f}% {row['predicted_step_s']:17.3f} "
              f"{100 * row['prediction_error']:+6.1f}%")
    summary["costs"] = costs.__dict__
    with open(os.path.join(args.root, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
