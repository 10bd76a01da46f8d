"""KV-cache generation at pp=2 (2 gloo ranks) vs transformers greedy `generate` and the unpipelined sampler."""
import torch
from models.hf_fixtures import make_causal_lm, random_ids
from parallel.dist_utils import run_distributed
from transformers import GenerationConfig

from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout, stage_from_pretrained
from megalign.rollout import SamplingParams, generate, pipeline_generate

PAD = 0


def _left_padded(lengths):
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = random_ids(1, n, seed=row)[0]
        mask[row, width - n:] = 1
    return ids, mask


def _check(path, ids, mask, greedy, ref_greedy, sampled, ref_sampled):
    layout = ParallelLayout.build(pp=2)
    stage = stage_from_pretrained(path, layout, vocab_pad_multiple=64).eval()  # padding rows must never win
    out = pipeline_generate(stage, ids, mask, greedy, layout)
    assert torch.equal(out.sequences, ref_greedy)  # on every stage: the token is broadcast from the last
    # only the last stage's generator is used: give the first stage another seed to show it
    generator = torch.Generator().manual_seed(5 if layout.is_last_stage else 123)
    out = pipeline_generate(stage, ids, mask, sampled, layout, generator)
    assert torch.equal(out.sequences, ref_sampled.sequences)
    assert torch.equal(out.attention_mask, ref_sampled.attention_mask)
    torch.testing.assert_close(out.logprobs, ref_sampled.logprobs, rtol=1e-5, atol=1e-5)


def test_pipeline_generate_matches_transformers_and_unpipelined(tmp_path):
    hf = make_causal_lm(tmp_path, "llama3_gqa", num_hidden_layers=4)
    ids, mask = _left_padded([3, 9, 6])

    def hf_greedy(eos):
        config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=eos, pad_token_id=PAD)
        with torch.no_grad():
            return hf.generate(ids, attention_mask=mask, generation_config=config)

    free = hf_greedy([])
    first = set(free[:, 9].tolist())
    eos = next(t for t in free[0, 10:].tolist() if t not in first)  # row 0 stops mid-way
    ref_greedy = hf_greedy([eos])
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_id=eos, pad_token_id=PAD)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9, pad_token_id=PAD)
    dense = from_pretrained(tmp_path, vocab_pad_multiple=64).eval()
    ref_sampled = generate(dense, ids, mask, sampled, torch.Generator().manual_seed(5))
    run_distributed(_check, tmp_path, ids, mask, greedy, ref_greedy, sampled, ref_sampled)
