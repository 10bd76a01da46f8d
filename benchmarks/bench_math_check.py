"""Answer-checking speed: rewards/s of the `math_accuracy` term under the `builtin` and `math_verify` checkers
(`megalign.rewards.math`), and math-verify called the way TRL's `accuracy_reward` calls it, side by side.

Workloads (N responses each, half right, every response a fresh string so no cache hides the parse):

- `arith`: the embedded GRPO task's responses, `\\boxed{N}` against an integer gold (right, off by a few,
  some malformed), the case where both checkers must agree and math_verify takes the builtin number path;
- `latex`: MATH-style answers the builtin parser mostly cannot equate (`\\frac{6}{8}` against `\\frac{3}{4}`,
  `\\sqrt{a}/b`, sets, `x=a`, `\\$a`), where math_verify runs SymPy;

Each side runs through `get_reward` (the `SafeReward` with its per-sample SIGALRM limit, as trainers call
it). The TRL-style side parses the whole response and the gold with math-verify's defaults and its own
signal timeouts on (`parse(...)`, `verify(...)`). Median of `--repeats` rounds, each on new rows with the parse
caches emptied first (a gold repeated within a round, as a GRPO group repeats it, may hit them), after a
warm-up round; every side sees the same rows. Prints the CPU and the load average (the machine is shared).

    python benchmarks/bench_math_check.py --n 2000 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from harness import cpu_model  # noqa: E402

from megalign.rewards import get_reward  # noqa: E402
from megalign.rewards import math as rmath  # noqa: E402
from megalign.rewards.math import have_math_verify  # noqa: E402


def arith_rows(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """(response, gold) of the embedded task: half right, the rest off by 1-3 or malformed."""
    rows = []
    for _ in range(n):
        gold = rng.randint(-20, 400)
        value = gold if rng.random() < 0.5 else gold + rng.choice([-3, -2, -1, 1, 2, 3])
        form = rng.choice([r"\boxed{{{v}}}", r"\boxed{{{v}}}", r"\boxed{{{v}}}", r"\boxed{{{v}", r"{v}"])
        rows.append((form.format(v=value), str(gold)))
    return rows


def latex_rows(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """(response, gold) of MATH-style LaTeX answers: half equivalent to the gold in another form, half not."""
    rows = []
    for _ in range(n):
        a, b, k = rng.randint(1, 99), rng.randint(2, 99), rng.randint(2, 9)
        right = rng.random() < 0.5
        d = 0 if right else 1
        kind = rng.randrange(5)
        if kind == 0:
            pred, gold = rf"\frac{{{k * a + d}}}{{{k * b}}}", rf"\frac{{{a}}}{{{b}}}"
        elif kind == 1:
            pred, gold = rf"\sqrt{{{a + d}}}/{b}", rf"\frac{{\sqrt{{{a}}}}}{{{b}}}"
        elif kind == 2:
            pred, gold = rf"\{{{b}, {a + d}\}}", rf"\{{{a}, {b}\}}"
        elif kind == 3:
            pred, gold = f"x={a + d}", str(a)
        else:
            pred, gold = rf"\${a * 10 + d}", str(a * 10)
        rows.append((rf"The answer is $\boxed{{{pred}}}$.", gold))
    return rows


def trl_style(rows):
    """math-verify as TRL's accuracy_reward calls it: whole response and gold parsed with its defaults and its
    signal timeouts on."""
    from math_verify import parse, verify
    return [float(verify(parse(gold), parse(response))) for response, gold in rows]


def clear_caches() -> None:
    """Empty megalign's and math-verify's parse caches, so no side profits from another's parses."""
    from math_verify import parser

    rmath._mv_parse.cache_clear()
    parser.parse_latex_cached.cache_clear()
    parser.parse_expr_cached.cache_clear()


def rate(fn, make, n: int, rng: random.Random, repeats: int) -> tuple[float, float]:
    """(median rewards/s, mean reward) of `fn(rows)` over `repeats` rounds, each on `n` new rows `make(n, rng)`
    (no parse cache carries over from a round to the next), after a warm-up round on other rows."""
    fn(make(min(n, 200), rng))
    times, scores = [], []
    for _ in range(repeats):
        rows = make(n, rng)
        clear_caches()
        start = time.perf_counter()
        round_scores = fn(rows)
        times.append(time.perf_counter() - start)
        scores += round_scores
    return n / statistics.median(times), sum(scores) / len(scores)


def term(checker: str):
    reward = get_reward("math_accuracy", options={"checker": checker})
    return lambda rows: list(reward([""] * len(rows), [r for r, _ in rows], [g for _, g in rows]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="responses per workload and round")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.n < 1 or args.repeats < 1:
        ap.error("--n and --repeats must be >= 1")
    if not have_math_verify():
        sys.exit("math-verify is not installed: pip install 'megalign[math]'")
    from importlib.metadata import version
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.2f}; math-verify {version('math-verify')}")
    print("| workload | checker | rewards/s | mean reward |\n|---|---|---:|---:|")
    for name, make in (("arith", arith_rows), ("latex", latex_rows)):
        sides = [("builtin", term("builtin")), ("math_verify", term("math_verify")),
                 ("math-verify as TRL calls it", trl_style)]
        for label, fn in sides:
            per_s, mean = rate(fn, make, args.n, random.Random(0), args.repeats)   # the same rows for every side
            print(f"| {name} | {label} | {per_s:,.0f} | {mean:.3f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
