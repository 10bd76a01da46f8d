"""KV-cache generation at pp=2, with tp=1 (2 gloo ranks) and tp=2 (4 ranks), vs transformers greedy `generate`
and the unpipelined tp=1 sampler."""
import pytest
import torch
from models.hf_fixtures import make_causal_lm, random_ids
from parallel.dist_utils import run_distributed
from transformers import GenerationConfig

from megalign.models import from_pretrained
from megalign.models import stage_from_pretrained
from megalign.parallel import ParallelLayout
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


def _check(path, tp, ids, mask, greedy, ref_greedy, sampled, ref_sampled):
    layout = ParallelLayout.build(tp=tp, pp=2)
    stage = stage_from_pretrained(path, layout, vocab_pad_multiple=64).eval()  # padding rows must never win
    k_proj = next(p for name, p in stage.named_parameters() if name.endswith("k_proj.weight"))
    assert k_proj.shape[0] == stage.config.num_key_value_heads * stage.config.head_dim // tp  # kv heads are sharded
    out = pipeline_generate(stage, ids, mask, greedy, layout)
    assert torch.equal(out.sequences, ref_greedy)  # on every rank: the token is broadcast from the last stage
    # only the generator of the last stage's tp rank 0 is used: give every other rank another seed to show it
    generator = torch.Generator().manual_seed(5 if layout.is_last_stage and layout.tp_rank == 0 else 123)
    out = pipeline_generate(stage, ids, mask, sampled, layout, generator)
    assert torch.equal(out.sequences, ref_sampled.sequences)
    assert torch.equal(out.attention_mask, ref_sampled.attention_mask)
    torch.testing.assert_close(out.logprobs, ref_sampled.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_generate_matches_transformers_and_unpipelined(tmp_path, tp):
    """Greedy tokens equal transformers'; seeded sampling equals the unpipelined tp=1 `generate` with the same seed.

    At tp=2 each stage's decode runs on its head shards with a vocab-sharded head (4 ranks, tp innermost), so
    the hidden states sent between stages, the gathered logits and the sampled token's agreement are all exercised.
    """
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
    run_distributed(_check, tmp_path, tp, ids, mask, greedy, ref_greedy, sampled, ref_sampled, world_size=2 * tp)
