"""Fingerprints of every trainer for a fixed seed, to show a refactor changes no metric and no weight.

    python scripts/trainer_fingerprints.py run OUT.json [LABEL ...]  # every example (or those) for 3 steps
    python scripts/trainer_fingerprints.py compare A.json B.json

`run` trains each `examples/*.yaml` with the tiny overrides of `tests/trainers/test_examples.py` for three
steps (plus GRPO, PPO and DPO at pp = 2 on two gloo ranks), then records each step's metrics (timings,
memory and throughput left out: they differ between any two runs) and, per exported HF tensor, its sum and
sum of squares in float64 (labels: the example's name, `<name>@pp2` for the pipelined variants). `compare` prints the largest absolute and relative difference per run and exits
non-zero when a run, a metric or a tensor is missing on one side.
"""
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests")]

STEPS = ["steps=3", "export_hf=true"]
PIPELINED = {"grpo_arith": ["actor.pp=2", "algo.micro_batch_size=2"], "ppo_arith": ["actor.pp=2", "critic.pp=2",
             "algo.micro_batch_size=2"], "dpo_arith": ["model.pp=2", "model.microbatches=2"]}
NOISY = ("time/", "memory/", "mem/", "tokens_per_s", "_per_s", "rss", "cuda_")


def _train(root, example, run_dir, out, *overrides):
    import torch.distributed as dist
    from safetensors.torch import load_file
    from trainers.test_examples import QUICK

    from megalign.algos.registry import load as load_algorithm

    os.chdir(root)
    algo, cfg = load_algorithm(example, [f"run_dir={run_dir}", *QUICK, *overrides, *STEPS])
    result = algo.train_fn()(cfg)
    if dist.get_rank() != 0:
        return
    metrics = [{k: v for k, v in row.items() if not any(n in k for n in NOISY)} for row in result.metrics]
    weights = {}
    for name in sorted(os.listdir(result.hf_path)):
        if name.endswith(".safetensors"):
            for key, value in load_file(os.path.join(result.hf_path, name)).items():
                value = value.double()
                weights[key] = [float(value.sum()), float((value ** 2).sum())]
    with open(out, "w") as f:
        json.dump({"metrics": metrics, "weights": weights}, f)


def run(out_path, only=()):
    import pathlib

    from parallel.dist_utils import run_distributed
    from trainers.test_examples import EXAMPLES, OVERRIDES, build_runs

    root = build_runs(pathlib.Path(tempfile.mkdtemp(prefix="fingerprints")))
    results = {}
    jobs = [(os.path.basename(e)[:-5], e, [], 1) for e in EXAMPLES]
    jobs += [(f"{name}@pp2", e, PIPELINED[name], 2) for name, e in
             ((os.path.basename(e)[:-5], e) for e in EXAMPLES) if name in PIPELINED]
    for label, example, extra, world in [job for job in jobs if not only or job[0] in only]:
        name = label.split("@")[0]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "fingerprint.json")
            run_distributed(_train, root, example, os.path.join(tmp, "run"), out, *OVERRIDES[name], *extra,
                            world_size=world, timeout_s=600)
            with open(out) as f:
                results[label] = json.load(f)
        print(label, "done", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


def compare(a_path, b_path):
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    missing = sorted(set(a) ^ set(b))
    for label in sorted(set(a) & set(b)):
        worst_abs, worst_rel, where = 0.0, 0.0, ""
        pairs = [(f"weight {k}[{i}]", x, y) for k in a[label]["weights"] for i, (x, y) in
                 enumerate(zip(a[label]["weights"][k], b[label]["weights"].get(k, [math.nan] * 2)))]
        for step, (ra, rb) in enumerate(zip(a[label]["metrics"], b[label]["metrics"])):
            missing += [f"{label} step {step + 1}: {k}" for k in sorted(set(ra) ^ set(rb))]
            pairs += [(f"step {step + 1} {k}", ra[k], rb[k]) for k in ra if k in rb]
        for what, x, y in pairs:
            diff = abs(x - y) if math.isfinite(x) and math.isfinite(y) else (0.0 if x == y else math.inf)
            rel = diff / max(abs(x), abs(y), 1e-12)
            if rel > worst_rel:
                worst_abs, worst_rel, where = diff, rel, what
        print(f"{label:24s} {len(pairs):5d} values  max |diff| {worst_abs:.3g}  max rel {worst_rel:.3g}  {where}")
    for item in missing:
        print("missing on one side:", item)
    return 1 if missing else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"] and len(sys.argv) >= 3:
        run(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(__doc__)
