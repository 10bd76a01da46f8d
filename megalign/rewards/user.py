"""Load a user reward function named in a config: `"package.module:function"` or `"path/to/file.py:function"`.

Every failure (no colon, the module or file cannot be imported, no such attribute, not callable,
a signature that cannot take the four arguments) raises `RewardSpecError` naming the spec, at load
time, so a typo in the config stops the run before any GPU time is spent rather than scoring 0
for every sample.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Callable


class RewardSpecError(ValueError):
    """A reward function spec that does not resolve to a usable function."""


def _import_file(path: str, spec: str):
    if not os.path.isfile(path):
        raise RewardSpecError(f"reward function {spec!r}: file {path!r} does not exist")
    # A name unique per absolute path, so two files called reward.py do not replace each other.
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    module_name = f"megalign_user_reward_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_function(spec: str, nargs: int = 4) -> Callable:
    """The callable named by `spec`, checked to accept `nargs` positional arguments.

    Reward functions take `(prompt, response, answer, metadata)`, hence `nargs=4`.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise RewardSpecError(f"reward function {spec!r} must look like 'module:function' or 'path/to/file.py:function'")
    try:
        module = _import_file(target, spec) if target.endswith(".py") else importlib.import_module(target)
    except RewardSpecError:
        raise
    except Exception as exc:
        raise RewardSpecError(f"reward function {spec!r}: cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        raise RewardSpecError(f"reward function {spec!r}: {target!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardSpecError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not callable")
    try:
        inspect.signature(fn).bind(*range(nargs))
    except TypeError as exc:
        raise RewardSpecError(f"reward function {spec!r} must accept {nargs} positional arguments: {exc}") from exc
    except ValueError:
        pass  # builtins without an introspectable signature: trust them
    return fn
