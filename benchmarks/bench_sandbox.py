"""Sandbox throughput: executions per second of a tiny program through `SandboxPool`, and the `code_tests` reward
on a small generated code task, side by side with an unisolated baseline.

- `sandbox pool, W workers`: `SandboxPool(W).map` of N copies of `print(sum(range(10)))`, each a full
  sandboxed execution (fresh namespaces, tmpfs root, privileges dropped, temporary directory made and
  removed). `sandbox pool, a failing assert`: the same with `assert sum(range(10)) == 44`, whose traceback the
  sandbox prints (its modules are imported by the fork server, not per execution: `megalign/sandbox/_boot.py`).
- `plain subprocess, W threads`: the same program as `python -I -S -c PROGRAM` through `subprocess.run`
  with setrlimit in a preexec and a timeout, W threads at once: what a peer's `setrlimit + alarm` sandbox
  costs (no namespaces, no fork server: an interpreter start-up per execution).
- `code_tests`: the reward term (`SafeReward` over `CodeTests`, as the trainer builds it) on a batch of responses
  to "write f(x) = 3x^2 + 2x - 1" (half right, half off by one), T hidden assert tests per response (T = 8, then
  5: a count the workers do not divide), each test an execution; executions/s = responses x T / seconds.
  `batched`: the term's staged path, every test of the batch submitted at once; `one response at a time`: the
  per-sample order the term used before (each response's T tests in parallel, the responses in turn), for the
  ratio. Both on the same pool, scores checked 1 / 0. Beside them,
  `sandbox pool, the code task's programs`: the bare pool on the same executions (code + one assert each), the
  ceiling the reward can reach.

`--boot-before FILE` measures only the fork server's change instead: `sandbox pool` and `a failing assert` with
FILE as the fork server (an earlier `megalign/sandbox/_boot.py`: `git show REV:megalign/sandbox/_boot.py > FILE`)
and with the current one, at each of `--workers`, the four in turn within every round, so a load that comes and
goes on the shared cores weighs on all four alike; medians of `--repeats` rounds after a warm-up.

Target (issue 28): >= 200 executions/s on 2 cores for a tiny program. Median of `--repeats` rounds after a
warm-up round. Prints the CPU (`lscpu`'s model name) and the load average (before, after each row, at the end): the
machine is shared, and the benchmark itself adds up to its worker count to the load.
"""
from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
from harness import cpu_model  # noqa: E402

from megalign.rewards import SafeReward  # noqa: E402
from megalign.rewards.code_tests import CodeTests, extract_code  # noqa: E402
import megalign.sandbox.core as sandbox_core  # noqa: E402
from megalign.sandbox import Sandbox, SandboxPool  # noqa: E402

PROGRAM = "print(sum(range(10)))"
FAILING = "assert sum(range(10)) == 44"


def rate(fn, n: int, repeats: int) -> float:
    """Median executions per second of `fn()` (which runs n executions) over `repeats` rounds after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return n / statistics.median(times)


def row(side: str, workers: int, rate_per_s: float) -> None:
    """One table row, with the 1-minute load average after it: the 2 cores are shared, and a row measured while
    another job held them shows there."""
    print(f"| {side} | {workers} | {rate_per_s:.0f} | {os.getloadavg()[0]:.2f} |", flush=True)


def plain_subprocess_rate(workers: int, n: int, repeats: int) -> float:
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))

    def limits():
        resource.setrlimit(resource.RLIMIT_CPU, (2, 3))
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    def one(_):
        return subprocess.run([python, "-I", "-S", "-c", PROGRAM], capture_output=True, timeout=5, preexec_fn=limits)

    with ThreadPoolExecutor(workers) as ex:
        return rate(lambda: list(ex.map(one, range(n))), n, repeats)


def code_task(n_responses: int, n_tests: int):
    """`n_responses` responses to "write f(x) = 3x^2 + 2x - 1" (even: right, odd: off by one) and the row's metadata
    with `n_tests` (<= 8) hidden assert tests."""
    right = "```python\ndef f(x):\n    return 3 * x * x + 2 * x - 1\n```"
    off = "```python\ndef f(x):\n    return 3 * x * x + 2 * x\n```"
    tests = [f"assert f({x}) == {3 * x * x + 2 * x - 1}" for x in (-3, -1, 0, 1, 2, 5, 10, 17)[:n_tests]]
    return [right if i % 2 == 0 else off for i in range(n_responses)], {"tests": tests}


def code_tests_rates(workers: int, n_tests: int, n_responses: int, repeats: int) -> None:
    """Print the rows of the code task at `workers`: the bare pool on its programs, then the reward batched and one
    response at a time (scores checked against the right / off-by-one answers: 1 / 0)."""
    responses, meta = code_task(n_responses, n_tests)
    n = n_responses
    expected = [1.0 if i % 2 == 0 else 0.0 for i in range(n)]
    programs = [f"{extract_code(r)}\n\n{t}\n" for r in responses for t in meta["tests"]]
    with SandboxPool(workers, Sandbox(timeout_s=2)) as pool:
        r = rate(lambda: pool.map(programs), len(programs), repeats)
    row(f"sandbox pool, the code task's programs ({n_tests} per response, half fail an assert)", workers, r)
    fn = CodeTests(timeout_s=2, workers=workers)
    term = SafeReward(fn, "code_tests")
    sides = {"batched, the whole batch submitted at once": lambda: term([""] * n, responses, [None] * n, [meta] * n),
             "one response at a time (per-sample order)": lambda: [fn("", r, None, meta) for r in responses]}
    for side, score in sides.items():
        scores = []
        r = rate(lambda: scores.append(score()), len(programs), repeats)
        assert scores[-1] == expected and term.errors == 0, (scores[-1], term.metrics())
        row(f"code_tests reward, {n_tests} tests per response, {side}", workers, r)
    fn.close()


def boot_before_rates(boot_before: str, workers: int, n: int, repeats: int) -> None:
    """Rows of `--boot-before`: passing and failing programs through a pool whose fork server runs `boot_before`,
    and through one running the current `_boot.py`, interleaved round by round."""
    pools = {}
    for name, boot in ((f"fork server {boot_before}", boot_before), ("fork server of this checkout", sandbox_core.BOOT)):
        current, sandbox_core.BOOT = sandbox_core.BOOT, boot  # read when the pool's first run starts the server
        pools[name] = SandboxPool(workers, Sandbox(timeout_s=2))
        pools[name].map([PROGRAM])
        sandbox_core.BOOT = current
    sides = list(itertools.product(pools, (("passing", PROGRAM), ("a failing assert", FAILING))))
    times = {side: [] for side in sides}
    for round_ in range(repeats + 1):
        for side in sides:
            (name, (_, program)) = side
            start = time.perf_counter()
            pools[name].map([program] * n)
            if round_:
                times[side].append(time.perf_counter() - start)
    for (name, (kind, _)), t in times.items():
        row(f"sandbox pool, {name}, {kind}", workers, n / statistics.median(t))
    for pool in pools.values():
        pool.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=400, help="executions per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--boot-before", help="an earlier fork server script: measure only it against the current one")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; python {sys.version.split()[0]}; "
          f"load average before: {os.getloadavg()}")
    print("| side | workers | executions/s | load after |\n|---|---:|---:|---:|")
    if args.boot_before:
        for w in (int(x) for x in args.workers.split(",")):
            boot_before_rates(args.boot_before, w, args.n, args.repeats)
        print(f"load average after: {os.getloadavg()}")
        return
    for w in (int(x) for x in args.workers.split(",")):
        with SandboxPool(w, Sandbox(timeout_s=2)) as pool:
            r = rate(lambda: pool.map([PROGRAM] * args.n), args.n, args.repeats)
            row("sandbox pool", w, r)
            r = rate(lambda: pool.map([FAILING] * args.n), args.n, args.repeats)
            row("sandbox pool, a failing assert", w, r)
        row("plain subprocess (rlimits only)", w, plain_subprocess_rate(w, args.n, args.repeats))
    for n_tests in (8, 5):
        for w in (2, 4):
            code_tests_rates(w, n_tests, args.n // n_tests, args.repeats)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
