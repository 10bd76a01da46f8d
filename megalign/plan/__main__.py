"""`python -m megalign.plan`: the memory plan of a planner file or of a megalign run config (see `megalign.plan`).

    python -m megalign.plan --config examples/plan/grpo_llama3_70b.yaml [key=value ...] [--json]
    python -m megalign.plan --run-config examples/grpo_arith.yaml --gpus 2 [--model llama3-8b] [key=value ...]

Overrides (`key.sub=value`) apply to the planner file, or to the run config with --run-config.
Prints the table (or the JSON with --json); exits 0 when the plan fits, 1 when it does not, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

from megalign.config import ConfigError, load_config
from megalign.plan.planner import PlanConfig, plan_memory
from megalign.plan.runconfig import plan_from_run_config


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m megalign.plan", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="planner YAML (keys of megalign.plan.PlanConfig)")
    source.add_argument("--run-config", help="a megalign trainer config (examples/*.yaml)")
    parser.add_argument("--gpus", type=int, help="--run-config: world size of the run")
    parser.add_argument("--model", help="--run-config: architecture (preset or config.json) instead of the checkpoint's")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="--run-config: memory of one GPU (GiB)")
    parser.add_argument("--attention", choices=("flash", "sdpa"), default="flash", help="--run-config: attention backend")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    parser.add_argument("overrides", nargs="*", help="key.sub=value")
    args = parser.parse_args(argv)
    if args.run_config and args.gpus is None:
        parser.error("--run-config needs --gpus")
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        if args.config:
            estimate = plan_memory(load_config(PlanConfig, args.config, args.overrides))
        else:
            plan, model = plan_from_run_config(args.run_config, args.gpus, args.model, overrides=args.overrides,
                                               gpu_memory_gib=args.gpu_memory_gib, attention=args.attention)
            estimate = plan_memory(plan, model)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(json.dumps(estimate.as_dict(), indent=1) if args.json else estimate.table())
    return 0 if estimate.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
