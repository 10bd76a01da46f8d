"""Every megalign:: op has a kernel for the given dispatch key (default CUDA): a build that left
one out would otherwise fall back nowhere and fail only when a trainer first calls it.

    python scripts/check_op_kernels.py [CUDA|CPU]
"""
import sys

import torch

import megalign.ops as ops

key = sys.argv[1] if len(sys.argv) > 1 else "CUDA"
assert ops.HAVE_EXTENSION, "megalign._C is not built"
assert key != "CUDA" or ops.WITH_CUDA, "megalign._C was built without its CUDA kernels"
names = sorted({s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("megalign::")})
missing = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(f"megalign::{n}", key)]
assert names and not missing, f"ops without a {key} kernel: {missing}"
print(f"{len(names)} megalign ops, each with a {key} kernel: {', '.join(names)}")
