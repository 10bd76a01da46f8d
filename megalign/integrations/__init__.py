"""megalign's kernels inside other frameworks' trainers, patched in with one call.

`megalign.integrations.trl`: TRL's `GRPOTrainer` and `DPOTrainer` (and `selective_log_softmax`)
on megalign's `token_logprob` and fused policy loss. Nothing here imports the other framework
until the patch call, so megalign never depends on it at import time.
"""
from megalign.integrations.trl import apply_megalign_kernels_to_trl, megalign_kernels_in_trl, unpatch_trl

__all__ = ["apply_megalign_kernels_to_trl", "megalign_kernels_in_trl", "unpatch_trl"]
