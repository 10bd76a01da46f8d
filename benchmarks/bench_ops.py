"""Every kernel benchmark side by side with its peers, as one markdown table.

    python benchmarks/bench_ops.py            # the sizes quoted in BENCHMARKS.md (minutes on 2 cores)
    python benchmarks/bench_ops.py --quick    # small sizes, seconds: a smoke test of the harness
    python benchmarks/bench_ops.py --only gae,group_advantages

Each benchmark module exposes `run(quick) -> list[harness.Row]`; ratios in the table are peer time
(or peak extra memory) over megalign's in the same case, so >1 means megalign is ahead.
"""
import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import format_table, machine_line  # noqa: E402

MODULES = ["bench_token_logprob", "bench_kl_policy", "bench_advantages"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--only", default="", help="comma-separated op names to keep (e.g. gae,policy_loss)")
    args = parser.parse_args()
    keep = {s.strip() for s in args.only.split(",") if s.strip()}

    rows = []
    for name in MODULES:
        rows += importlib.import_module(name).run(quick=args.quick)
    if keep:
        rows = [r for r in rows if r.op in keep]
    print(machine_line())
    print(format_table(rows))


if __name__ == "__main__":
    main()
