"""Rollouts on the training weights: KV-cache generation and sampling (see `generate`)."""
from .generate import GenerationOutput, SamplingParams, filter_logits, generate, pipeline_generate, sample_next

__all__ = ["GenerationOutput", "SamplingParams", "filter_logits", "generate", "pipeline_generate", "sample_next"]
