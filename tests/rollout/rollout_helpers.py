"""Prompt batches shared by the rollout tests."""
import torch
from models.hf_fixtures import random_ids

from megalign.rollout import EngineConfig

CONFIGS = {  # engine configurations that must give the same samples whatever the batching
    "all_at_once": EngineConfig(),
    "continuous_3": EngineConfig(max_batch=3, sync_every=1, prefill_batch=1),
    "static_4": EngineConfig(max_batch=4, sync_every=3, static=True),
}

PAD = 0


def left_padded(lengths, seed=0):
    """(ids, mask) `[len(lengths), max(lengths)]`: random prompts of the given lengths, padded on the left with PAD."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = random_ids(1, n, seed=seed + row)[0]
        mask[row, width - n:] = 1
    return ids, mask


def fresh_log_softmax(model, out, temperature):
    """`[B, N, V]` log softmax(logits / T) at the positions that predicted each generated token of `out`
    (a `GenerationOutput`), in one forward of `model`."""
    prompt_len = out.sequences.shape[1] - out.logprobs.shape[1]
    with torch.no_grad():
        logits = model(out.sequences, attention_mask=out.attention_mask)[:, prompt_len - 1:-1].float()
    return (logits / temperature).log_softmax(-1)
