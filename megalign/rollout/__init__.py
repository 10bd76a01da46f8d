"""Rollouts on the training weights: the fast engine (`rollout`: shared-prompt prefill, continuous batching, a
static decode step), the `RolloutBatch` the online trainers fill from it, its pp > 1 form with micro-batches in flight across the stages (`pipeline_rollout`), and the
simple KV-cache loop they are checked against (`generate`; `pipeline_generate` its stage-after-stage pp form), and
multi-turn episodes against environments (`multiturn_rollout`, `episodes_to_batch`)."""
from .batch import RolloutBatch
from .engine import EngineConfig, RolloutStats, pick_tokens, rollout, stream_keys, stream_uniforms
from .generate import GenerationOutput, SamplingParams, filter_logits, generate, pipeline_generate, sample_next
from .multiturn import Episode, MultiTurnConfig, MultiTurnStats, episodes_to_batch, multiturn_rollout
from .pipeline import pipeline_rollout

__all__ = ["EngineConfig", "Episode", "GenerationOutput", "MultiTurnConfig", "MultiTurnStats", "episodes_to_batch",
           "multiturn_rollout", "RolloutBatch", "RolloutStats", "SamplingParams", "filter_logits", "generate",
           "pick_tokens", "pipeline_generate", "pipeline_rollout", "rollout", "sample_next", "stream_keys", "stream_uniforms"]
