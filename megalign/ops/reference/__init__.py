"""Pure-PyTorch references of every megalign op: the same math as the kernels, written for
clarity and accuracy over speed. Each computes in float64 (over chunks of rows where a [N, V]
tensor would be large) and rounds its results once to the op's output dtype, so it is within
about 0.5 ulp of the exact value and a fair yardstick for the fp32 kernels. Tests compare the kernels
and these references with a float64 oracle; MEGALIGN_OPS=reference runs them.

Each op's reference lives in the submodule of the same name (`megalign.ops.reference.gae.gae`,
...); the package does not re-export them so the submodule names stay modules.
"""
