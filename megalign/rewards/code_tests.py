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
    - a string of Python statements (usually `assert f(2) == 5`): it runs after the code in one program,
      followed by a line printing a fresh random token, and passes when that program exits with status 0
      having printed the token as its last line. Exit status alone is not enough: a response that calls
      `os._exit(0)` or `sys.exit(0)` (or swallows SystemExit at exit) would skip every assert and still exit 0,
      which RL finds. Code that runs in the same process as its tests can still forge the token on purpose (it
      can read its own code object), as with any in-process checker; the token closes the cheap exits.
  Every test is its own sandboxed execution (its own limits: an endless loop in one test costs only that
  test), run in parallel on a `SandboxPool`. No tests in the row is an error (the term's failure counter
  sees it), not a reward of 0.
- `CodeTests(timeout_s=..., memory_mb=..., workers=...)` builds the term with other limits, for a user
  module to name in the config; `code_tests` is the default (2 s per test, 256 MB, 4 workers). The pool is
  created on the first call, so importing this module starts no process.
- Batches: `code_tests` is a `StagedReward`, so `SafeReward` submits every test of every response of the
  batch to the pool before it waits on any (no worker idles while one response's slowest test finishes), then
  collects the responses in order. Scores are those of the per-sample call (`code_tests(prompt, response,
  answer, metadata)`, the same code: `start(...)()`).
- Time: a response's wait begins when the responses before it are collected, and then at most
  ceil(tests / workers) x timeout_s remain when every test runs into its limit (the pool runs executions in
  submission order); the trainer's per-sample `reward.timeout_s` (default 10 s) must be above that, or the
  sample is a counted failure (its executions still running end within their own limits in the pool's
  threads, and the responses after it wait behind them).
"""
from __future__ import annotations

import json
import re
import secrets
import threading
from typing import Any, Callable, Mapping, Optional

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


class CodeTests:
    """The `code_tests` reward term: `fn(prompt, response, answer, metadata) -> float in [0, 1]` (the fraction of
    the row's tests passed) and, staged, `fn.start(...) -> finish` (module doc). Each execution gets `timeout_s`
    (wall; CPU rounded up) and `memory_mb`, at most `workers` at once."""

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 256, workers: int = 4):
        self.sandbox = Sandbox(timeout_s=timeout_s, memory_mb=memory_mb)
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.workers = workers
        self._pool: Optional[SandboxPool] = None
        self._lock = threading.Lock()

    def _get_pool(self) -> SandboxPool:
        with self._lock:
            if self._pool is None:
                self._pool = SandboxPool(self.workers, self.sandbox)
            return self._pool

    def start(self, prompt: str, response: str, answer: Any, metadata: Mapping[str, Any]) -> Callable[[], float]:
        """Submit one execution per test of `metadata["tests"]` to the pool; the returned `finish()` waits for them
        and gives the fraction passed. Bad or missing tests raise here, before anything runs."""
        tests = _load_tests(metadata)
        code = extract_code(response)
        pool = self._get_pool()
        tokens = [None if isinstance(t, Mapping) else secrets.token_hex(16) for t in tests]
        futures = [pool.submit(code, str(t["input"])) if token is None
                   else pool.submit(f"{code}\n\n{t}\nprint({token!r})\n") for t, token in zip(tests, tokens)]

        def passed(test, token: Optional[str], outcome) -> bool:
            if outcome.status != "ok":
                return False
            if token is not None:  # an assert test: the asserts ran to their end (module doc)
                lines = outcome.stdout.rstrip().splitlines()
                return bool(lines) and lines[-1].strip() == token
            return _normalize_output(outcome.stdout) == _normalize_output(str(test["output"]))

        def finish() -> float:
            return sum(passed(t, token, f.result()) for t, token, f in zip(tests, tokens, futures)) / len(tests)

        return finish

    def __call__(self, prompt: str, response: str, answer: Any, metadata: Mapping[str, Any]) -> float:
        return self.start(prompt, response, answer, metadata)()

    def close(self) -> None:
        """Stop the pool (after its running executions), if one was started."""
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


code_tests = CodeTests()
