"""Native RLHF kernels with a pure-torch reference for each (`megalign.ops.reference`).

Each op validates its inputs, runs the C++/CUDA kernel when `megalign._C` is built for the
tensors' device (see `megalign.ops._backend` for the MEGALIGN_OPS switch), supports autograd, and
has a fake (meta) implementation so `torch.compile` can trace it. Names, types and constants that
the ops, their references and the algorithms share live in `megalign.ops.common`; only the ops'
reference fallback and the tests import `megalign.ops.reference`.
"""
from megalign.ops._backend import HAVE_EXTENSION, WITH_CUDA
from megalign.ops.gae import gae, masked_reward_count
from megalign.ops.group_advantages import group_advantages
from megalign.ops.kl_penalty import kl_penalty, kl_penalty_masked_mean
from megalign.ops.policy_loss import PolicyLossStats, policy_loss
from megalign.ops.token_logprob import (
    combine_vocab_partials,
    token_logprob,
    token_logprob_partials,
    token_logprob_shard_backward,
)

__all__ = [
    "HAVE_EXTENSION",
    "PolicyLossStats",
    "WITH_CUDA",
    "combine_vocab_partials",
    "gae",
    "group_advantages",
    "kl_penalty",
    "kl_penalty_masked_mean",
    "masked_reward_count",
    "policy_loss",
    "token_logprob",
    "token_logprob_partials",
    "token_logprob_shard_backward",
]
