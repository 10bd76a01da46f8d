"""The op path switch: without a built extension megalign.ops warns once and runs the references;
MEGALIGN_OPS=kernels turns the missing extension into an error; a bad MEGALIGN_OPS value is named."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs in a fresh interpreter in which `megalign._C` cannot be imported, as in a source checkout
# that was never built.
_NO_EXTENSION = """
import importlib.abc, sys, warnings
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "megalign._C":
            raise ImportError("blocked for the test")
sys.meta_path.insert(0, _Block())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import megalign.ops as ops
    import torch
    logits = torch.tensor([[0.0, 1.0986122886681098]])
    logp = ops.token_logprob(logits, torch.tensor([1]))
print(ops.HAVE_EXTENSION, len([w for w in caught if "megalign._C is not built" in str(w.message)]),
      round(float(logp), 6))
"""


def _run(code, **env):
    full_env = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd=ROOT)


def test_without_extension_warns_once_and_uses_reference():
    out = _run(_NO_EXTENSION, MEGALIGN_OPS="auto")
    assert out.returncode == 0, out.stderr
    # log(3/4) = -0.287682: the reference computed it.
    assert out.stdout.split() == ["False", "1", "-0.287682"]


def test_kernels_mode_without_extension_is_an_error():
    out = _run(_NO_EXTENSION, MEGALIGN_OPS="kernels")
    assert out.returncode != 0
    assert "MEGALIGN_OPS=kernels but no megalign kernel for cpu" in out.stderr


def test_unknown_mode_is_named(monkeypatch):
    from megalign.ops import _backend

    monkeypatch.setenv("MEGALIGN_OPS", "fast")
    with pytest.raises(ValueError, match="MEGALIGN_OPS='fast'"):
        _backend.mode()
