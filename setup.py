"""Build megalign._C: the CPU kernels always, the CUDA kernels where a CUDA torch and nvcc exist.

Environment:
  MEGALIGN_SKIP_CUDA_BUILD=1   build the CPU kernels only, even with a CUDA torch.
  MEGALIGN_CUDA_ARCHS          semicolon list of SM versions for the CUDA kernels (default "80;90").
  MEGALIGN_CPU_ARCH            a -march for the whole extension (default none: the build runs on any
                               CPU of its architecture). The vector kernels do not need it: they are
                               compiled for each x86-64 level (SSE2, AVX2, AVX-512) and the CPU's
                               own level is chosen at run time (csrc/cpu/isa.h).
  MAX_JOBS                     parallel compile jobs (torch's cpp_extension honours it).
"""
import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extensions():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    cpu_arch = os.environ.get("MEGALIGN_CPU_ARCH", "")
    # No -std flag: cpp_extension adds the standard its headers need (C++17; C++20 from torch 2.14).
    # -ffp-contract=fast: a * b + c may become one FMA where the ISA has it (an ISO -std turns it off).
    cxx = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast", "-Wno-psabi"]
    if cpu_arch:
        cxx.append(f"-march={cpu_arch}")
    include = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc", "torch")]
    sources = _sources("csrc/cpu/*.cpp") + _sources("csrc/torch/*.cpp")

    with_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("MEGALIGN_SKIP_CUDA_BUILD", "0") != "1"
    )
    if not with_cuda:
        return [CppExtension("megalign._C", sources, include_dirs=include,
                             extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])]

    archs = [a.strip() for a in os.environ.get("MEGALIGN_CUDA_ARCHS", "80;90").split(";") if a.strip()]
    # No --use_fast_math: it would turn libm's log and IEEE division in finalize_row / group_scale into
    # lg2.approx, div.approx and flush-to-zero, where the CPU kernels use libm. The one fast
    # intrinsic is chosen in the source (math::kernel_exp's __expf, token_logprob.h).
    nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    for a in archs:
        nvcc += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    sources += _sources("csrc/cuda/*.cu") + _sources("csrc/torch/cuda/*.cpp")
    return [CUDAExtension("megalign._C", sources, include_dirs=include,
                          define_macros=[("MEGALIGN_WITH_CUDA", "1")],
                          extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=["-fopenmp"])]


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(
    packages=find_packages(include=["megalign", "megalign.*"]),
    ext_modules=_extensions(),
    cmdclass=_cmdclass(),
)
