"""megalign: a Megatron-style engine for aligning large language models.

`megalign.ops` holds the native RLHF kernels (token log-probabilities, KL estimators, the fused
policy loss, GAE, group-normalised advantages) with pure-torch references of the same math.
"""

__version__ = "0.1.0"
