"""Pure-PyTorch references of every megalign op: the same math as the kernels, written for
clarity over speed. Tests compare the kernels against these; MEGALIGN_OPS=reference runs them.
"""
