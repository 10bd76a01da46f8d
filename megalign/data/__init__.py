"""Data for training: tokenizers (built-in character, HF, SentencePiece), prompt, SFT, preference, unpaired and
stepwise datasets, the prompt sampler, the arithmetic tasks."""
from megalign.data.arith import (
    ArithChain,
    ArithChainConfig,
    ArithProblem,
    ArithTaskConfig,
    chain_steps,
    corrupt_chain_steps,
    make_chain_splits,
    make_splits,
    preference_margin,
    preference_rows,
    solve_chain,
    stepwise_rows,
    unpaired_rows,
    write_jsonl,
    write_preference_jsonl,
    write_stepwise_jsonl,
    write_unpaired_jsonl,
    wrong_answer,
)
from megalign.data.preference import (
    OfflineDataStats,
    PreferenceExample,
    UnpairedExample,
    collate_preferences,
    collate_replies,
    collate_unpaired,
    encode_prompt,
    encode_prompt_and_replies,
    extract_prompt,
    load_preferences,
    load_unpaired,
)
from megalign.data.prompts import (
    DataError,
    DatasetStats,
    PromptDataset,
    PromptExample,
    PromptSampler,
    load_prompts,
    read_rows,
)
from megalign.data.sft import IGNORE_INDEX, SFTExample, collate_sft, encode_messages, encode_sft, load_sft
from megalign.data.stepwise import StepwiseExample, collate_stepwise, encode_steps, load_stepwise
from megalign.data.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerConfig,
    build_tokenizer,
    check_vocab,
)

__all__ = [
    "ArithChain", "ArithChainConfig", "ArithProblem", "ArithTaskConfig", "chain_steps", "corrupt_chain_steps",
    "make_chain_splits", "make_splits", "preference_margin", "preference_rows", "solve_chain", "stepwise_rows",
    "unpaired_rows", "write_jsonl", "write_preference_jsonl", "write_stepwise_jsonl", "write_unpaired_jsonl",
    "wrong_answer",
    "OfflineDataStats", "PreferenceExample", "UnpairedExample", "collate_preferences", "collate_replies", "collate_unpaired",
    "encode_prompt", "encode_prompt_and_replies", "extract_prompt", "load_preferences", "load_unpaired",
    "StepwiseExample", "collate_stepwise", "encode_steps", "load_stepwise",
    "DataError", "DatasetStats", "PromptDataset", "PromptExample", "PromptSampler", "load_prompts",
    "read_rows", "IGNORE_INDEX", "SFTExample", "collate_sft", "encode_messages", "encode_sft", "load_sft",
    "CharTokenizer", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "TokenizerConfig", "build_tokenizer",
    "check_vocab",
]
