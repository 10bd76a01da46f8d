"""The run-time choice of the CPU kernels' vector ISA (csrc/cpu/isa.h).

- the ISA in use is the widest the CPU supports, and MEGALIGN_CPU_ISA forces a lower one or fails
  with a message naming the variable;
- every ISA this CPU can run gives the same results (up to rounding) on odd shapes, all dtypes;
- no function of the built extension outside an ISA's own namespace contains AVX or AVX-512
  instructions, so the baseline kernels (and the glue) run on any x86-64 CPU, whatever machine
  built the extension.
"""
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megalign.ops import _backend

pytestmark = pytest.mark.skipif(not _backend.HAVE_EXTENSION, reason="megalign._C is not built")

NAMES = ("avx512", "avx2", "baseline")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _expected_isa() -> str:
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return "baseline"
    avx2 = {"avx2", "fma", "f16c", "bmi1", "bmi2"} <= flags
    if avx2 and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "avx512"
    return "avx2" if avx2 else "baseline"


def _run_python(code: str, isa: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGALIGN_CPU_ISA=isa, MEGALIGN_OPS="kernels")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def _available() -> list[str]:
    best = _expected_isa()
    return list(NAMES[NAMES.index(best):])


def test_isa_is_the_widest_the_cpu_supports():
    if "MEGALIGN_CPU_ISA" in os.environ:
        pytest.skip("MEGALIGN_CPU_ISA is set for this run")
    assert _backend._C.cpu_isa() == _expected_isa()


@pytest.mark.parametrize("isa", NAMES)
def test_forced_isa(isa):
    out = _run_python("import torch, megalign._C as c; print(c.cpu_isa())", isa)
    if isa in _available():
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == isa
    else:
        assert out.returncode != 0
        assert f"MEGALIGN_CPU_ISA={isa}: this CPU does not support {isa}" in out.stderr


def test_bad_isa_value_is_named():
    out = _run_python("import torch, megalign._C as c; c.cpu_isa()", "sse9")
    assert out.returncode != 0
    assert "MEGALIGN_CPU_ISA=sse9: expected auto, avx512, avx2 or baseline" in out.stderr
    # The ops raise the same error instead of running anything.
    out = _run_python("import torch; from megalign.ops import kl_penalty; "
                      "kl_penalty(torch.zeros(3), torch.zeros(3), 'k3')", "sse9")
    assert out.returncode != 0 and "MEGALIGN_CPU_ISA=sse9" in out.stderr


# Odd sizes (not multiples of 4, 8 or 16 lanes, a vocab shorter than a vector) in every dtype;
# each ISA's process saves its outputs, which must agree with the others' to a few ulp.
_CROSS_ISA = r"""
import sys, torch
from megalign.ops import token_logprob, kl_penalty, kl_penalty_masked_mean, policy_loss
out = {}
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for n, v in ((3, 5), (5, 37), (2, 2053)):
        x = (torch.randn(n, v, generator=g) * 3).to(dtype).requires_grad_()
        t = torch.randint(0, v, (n,), generator=g)
        logp, ent = token_logprob(x, t, temperature=0.7, return_entropy=True)
        (logp.sum() + 0.3 * ent.sum()).backward()
        out[f"tl{dtype}{n}x{v}"] = (logp.detach(), ent.detach(), x.grad.float())
    for b, c in ((1, 1), (3, 13), (2, 4101)):
        lp = (torch.randn(b, c, generator=g) * 0.3 - 1).to(dtype).requires_grad_()
        ref = (lp.detach().float() + torch.randn(b, c, generator=g) * 0.2).to(dtype)
        old = (lp.detach().float() + torch.randn(b, c, generator=g) * 0.2).to(dtype)
        adv = torch.randn(b, c, generator=g).to(dtype)
        mask = torch.rand(b, c, generator=g) > 0.3
        for kind in ("k1", "abs", "k2", "k3", "low_var_kl"):
            kl = kl_penalty(lp, ref, kind)
            (g1,) = torch.autograd.grad(kl.sum(), lp)
            m = kl_penalty_masked_mean(lp, ref, mask, kind)
            (g2,) = torch.autograd.grad(m, lp)
            out[f"kl{kind}{dtype}{b}x{c}"] = (kl.detach(), g1.float(), m.detach(), g2.float())
        loss, stats = policy_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                                  beta=0.05, ref_logp=ref)
        (g3,) = torch.autograd.grad(loss.sum(), lp)
        out[f"pl{dtype}{b}x{c}"] = (loss.detach(), g3.float(), torch.stack(list(stats)))
torch.save(out, sys.argv[1])
"""


def test_every_isa_gives_the_same_results(tmp_path):
    isas = _available()
    if len(isas) < 2:
        pytest.skip("this CPU runs only the baseline kernels")
    results = {}
    for isa in isas:
        path = tmp_path / f"{isa}.pt"
        env = dict(os.environ, MEGALIGN_CPU_ISA=isa, MEGALIGN_OPS="kernels")
        proc = subprocess.run([sys.executable, "-c", _CROSS_ISA, str(path)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        results[isa] = torch.load(path)
    base = results["baseline"]
    for isa in isas[:-1]:
        for key, tensors in results[isa].items():
            for a, b in zip(tensors, base[key]):
                # fp32 arithmetic in every dtype; FMA contraction and lane order differ by ISA.
                torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=lambda m: f"{isa} vs baseline, {key}: {m}")


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="needs x86-64 and objdump")
def test_only_isa_kernels_use_wide_instructions():
    so = _backend._C.__file__
    dump = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", so], capture_output=True, text=True,
                          check=True).stdout
    current, wide = None, {}
    for line in dump.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            current = m.group(1)
            continue
        if current is None or "\t" not in line:
            continue
        mnemonic = line.split("\t", 1)[1].split()[0] if line.split("\t", 1)[1].split() else ""
        # AVX / AVX-512 instructions are the VEX / EVEX-encoded ones: mnemonics starting with v
        # (verr / verw are old segment checks), plus anything touching ymm / zmm registers.
        if (mnemonic.startswith("v") and mnemonic not in ("verr", "verw")) or re.search(r"%[yz]mm\d", line):
            wide[current] = wide.get(current, 0) + 1
    kernels = [name for name in wide if "::avx2::" in name or "::avx512::" in name]
    offenders = [name for name in wide if name not in kernels]
    assert kernels, "no AVX2 / AVX-512 kernels found in the extension"
    assert not offenders, f"functions outside the ISA namespaces use AVX: {offenders[:10]}"
