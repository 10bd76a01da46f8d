"""Rollouts on the training weights: the fast engine (`rollout`: shared-prompt prefill, continuous batching, a
static decode step) and the simple KV-cache loop it is checked against (`generate`, also the pipeline's)."""
from .engine import EngineConfig, RolloutStats, pick_tokens, pipeline_rollout, rollout, stream_keys, stream_uniforms
from .generate import GenerationOutput, SamplingParams, filter_logits, generate, pipeline_generate, sample_next

__all__ = ["EngineConfig", "GenerationOutput", "RolloutStats", "SamplingParams", "filter_logits", "generate",
           "pick_tokens", "pipeline_generate", "pipeline_rollout", "rollout", "sample_next", "stream_keys", "stream_uniforms"]
