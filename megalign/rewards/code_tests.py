"""`code_tests`: run the code in a response against the dataset row's test cases in the sandbox; reward = the
fraction of tests passed. A user reward term: `{name: megalign.rewards.code_tests:code_tests}`.

Design choices (written down so users can predict the reward):

- Code (`extract_code`): the LAST fenced block labelled python / py / python3; without one, the last
  fenced block of any label; without any fence, the whole response (a model answering with bare code).
- Tests: `metadata["tests"]` (a list, or a JSON string holding one, as parquet columns store it). Each
  test is either
    - `{"input": str, "output": str}`: the code runs as a program with `input` on stdin and passes when
      its stdout equals `output` after trailing whitespace is removed from every line and trailing empty
      lines are dropped (the usual competitive-programming checker), and it exits with status 0;
    - a string of Python statements (usually `assert f(2) == 5`): it runs after the code in one program
      and passes when that program exits with status 0.
  Every test is its own sandboxed execution (its own limits: an endless loop in one test costs only that
  test), run in parallel on a `SandboxPool`. No tests in the row is an error (the term's failure counter
  sees it), not a reward of 0.
- `make_code_tests(timeout_s=..., memory_mb=..., workers=...)` builds the function with other limits, for
  a user module to name in the config; `code_tests` is the default (2 s per test, 256 MB, 4 workers).
  The pool is created on the first call, so importing this module starts no process.
- Time: a sample takes up to ceil(tests / workers) x timeout_s when every test runs into its limit; the
  trainer's per-sample `reward.timeout_s` (default 10 s) must be above that, or the sample is a counted
  failure (its executions still running end within their own limits in the pool's threads).
"""
from __future__ import annotations

import json
import re
import threading
from typing import Any, Callable, Mapping, Optional, Sequence

from megalign.sandbox import Sandbox, SandboxPool

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_LABELS = ("python", "py", "python3")


def extract_code(response: str) -> str:
    """The program in `response` (module docstring: the last python fence, else the last fence, else all)."""
    blocks = [(label.strip().lower(), body) for label, body in _FENCE.findall(response)]
    python = [body for label, body in blocks if label in _PYTHON_LABELS]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else response


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _load_tests(metadata: Mapping[str, Any]) -> list:
    tests = metadata.get("tests") if isinstance(metadata, Mapping) else None
    if isinstance(tests, str):
        tests = json.loads(tests)
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code_tests needs metadata['tests']: a non-empty list of {{input, output}} or assert "
                         f"strings, got {type(tests).__name__}")
    for i, test in enumerate(tests):
        if not (isinstance(test, str) or (isinstance(test, Mapping) and {"input", "output"} <= set(test))):
            raise ValueError(f"metadata['tests'][{i}] must be an assert string or {{input, output}}, got {test!r}")
    return tests


def make_code_tests(timeout_s: float = 2.0, memory_mb: int = 256, workers: int = 4) -> Callable[..., float]:
    """A `code_tests` reward function `fn(prompt, response, answer, metadata) -> float in [0, 1]` whose
    executions get `timeout_s` (wall; CPU rounded up) and `memory_mb` each, at most `workers` at once."""
    sandbox = Sandbox(timeout_s=timeout_s, memory_mb=memory_mb)
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    state: dict[str, Optional[SandboxPool]] = {"pool": None}
    lock = threading.Lock()

    def code_tests(prompt: str, response: str, answer: Any, metadata: Mapping[str, Any]) -> float:
        tests = _load_tests(metadata)
        code = extract_code(response)
        programs: Sequence[str] = [code if isinstance(t, Mapping) else f"{code}\n\n{t}\n" for t in tests]
        stdins = [str(t["input"]) if isinstance(t, Mapping) else "" for t in tests]
        with lock:
            if state["pool"] is None:
                state["pool"] = SandboxPool(workers, sandbox)
        outcomes = state["pool"].map(programs, stdins)
        passed = sum(o.status == "ok" and (isinstance(t, str) or
                                           _normalize_output(o.stdout) == _normalize_output(str(t["output"])))
                     for t, o in zip(tests, outcomes))
        return passed / len(tests)

    return code_tests


code_tests = make_code_tests()
