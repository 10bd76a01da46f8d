"""Pure-PyTorch references of every megalign op: the same math as the kernels, written for
clarity over speed. Tests compare the kernels against these; MEGALIGN_OPS=reference runs them.

Each op's reference lives in the submodule of the same name (`megalign.ops.reference.gae.gae`,
...); the package does not re-export them so the submodule names stay modules.
"""
