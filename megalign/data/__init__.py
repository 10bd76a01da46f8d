"""Data for training: tokenizers (built-in character, HF), prompt datasets and their sampler, the arithmetic task."""
from megalign.data.arith import ArithProblem, ArithTaskConfig, make_splits, write_jsonl
from megalign.data.prompts import (
    DataError,
    DatasetStats,
    PromptDataConfig,
    PromptDataset,
    PromptExample,
    PromptSampler,
    load_prompts,
)
from megalign.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, TokenizerConfig, build_tokenizer

__all__ = [
    "ArithProblem", "ArithTaskConfig", "make_splits", "write_jsonl",
    "DataError", "DatasetStats", "PromptDataConfig", "PromptDataset", "PromptExample", "PromptSampler", "load_prompts",
    "CharTokenizer", "HFTokenizer", "Tokenizer", "TokenizerConfig", "build_tokenizer",
]
