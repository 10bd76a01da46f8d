"""Megatron-style parallelism on torch.distributed: the layout object, tp collectives and layers,
vocab-parallel (and fused linear) token log-probs, data parallelism, mixed precision, pipeline schedules.

Everything takes its process groups explicitly (from a `ParallelLayout`); nothing here keeps global
process-group state. The same code runs on gloo/CPU and NCCL/GPU.
"""
from .collectives import (
    all_gather_last_dim,
    all_finite,
    all_reduce,
    all_reduce_count,
    broadcast_from_first,
    copy_to_group,
    gather_from_group,
    gather_to_first,
    reduce_from_group,
    scatter_to_group,
    split_last_dim,
)
from .data_parallel import (ExpertParallelZero, allreduce_embedding_gradients, allreduce_gradients, clip_grad_norm_,
                            ep_sharded_parameters, layout_optimizer, local_optimizers, pp_tied_parameters,
                            sync_gradients, zero1_optimizer)
from .layers import (
    ColumnParallelLinear,
    Embedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
    tp_sharded_parameters,
)
from .layout import ParallelLayout, StageSplit, group_ranks, rank_coords
from .logprob import fused_linear_token_logprob, vocab_parallel_token_logprob
from .pipeline import MicroBatchSums, Pipeline, stage_layer_range
from .precision import MixedPrecision

__all__ = [
    "ParallelLayout", "StageSplit", "rank_coords", "group_ranks",
    "copy_to_group", "reduce_from_group", "scatter_to_group", "gather_from_group",
    "all_reduce", "all_reduce_count", "all_gather_last_dim", "split_last_dim", "broadcast_from_first", "gather_to_first", "all_finite",
    "Embedding", "VocabParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear", "pad_vocab_size",
    "tp_sharded_parameters",
    "vocab_parallel_token_logprob", "fused_linear_token_logprob",
    "allreduce_gradients", "zero1_optimizer", "clip_grad_norm_", "allreduce_embedding_gradients",
    "pp_tied_parameters", "ep_sharded_parameters", "sync_gradients", "layout_optimizer", "local_optimizers",
    "ExpertParallelZero", "MixedPrecision",
    "MicroBatchSums", "Pipeline", "stage_layer_range",
]
