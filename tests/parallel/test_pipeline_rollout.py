"""`pipeline_rollout` at pp=2 (2 gloo ranks; tp=2 x pp=2 on 4) vs the engine's `rollout` on the unsplit model at pp=1
with the same seed: the same tokens, stopping points and log-probs on every rank, whatever the number of micro-batches."""
import pytest
import torch
from models.hf_fixtures import make_causal_lm
from parallel.dist_utils import run_distributed
from rollout.rollout_helpers import PAD, left_padded

from megalign.models import from_pretrained, stage_from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rollout import EngineConfig, SamplingParams, pipeline_rollout, rollout

GROUP = 3
LENGTHS = [3, 9, 6, 5]  # uneven prompts; 4 x 3 = 12 rows
# m = pp = 2; the default m = 2 pp = 4; m = 5 with 12 rows not divisible by 5 (micro-batches cut through the prompts'
# groups of 3) and one prompt per prefill chunk
CONFIGS = [EngineConfig(pp_microbatches=2), EngineConfig(), EngineConfig(pp_microbatches=5, prefill_batch=1)]


def _check(path, tp, ids, mask, cases):
    layout = ParallelLayout.build(tp=tp, pp=2)
    stage = stage_from_pretrained(path, layout, vocab_pad_multiple=64).eval()  # padding rows must never win
    for params, seed, ref in cases:
        for config in CONFIGS:
            # only the last stage's seed is used (broadcast from its tp rank 0): the first stage passes another
            out, stats = pipeline_rollout(stage, ids, mask, GROUP, params, seed if layout.is_last_stage else 99, layout,
                                          config)
            assert torch.equal(out.sequences, ref.sequences), (config, layout.rank)
            assert torch.equal(out.attention_mask, ref.attention_mask)
            torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
            assert stats.decode_tokens == int(ref.attention_mask[:, ids.shape[1]:].sum())
            assert 0 <= stats.recv_wait_s <= stats.prefill_s + stats.decode_s


def _stops(dense, ids, mask, params):
    """Stop tokens taken from an unconstrained run's third and fifth response tokens, so rows end mid-way."""
    free, _ = rollout(dense, ids, mask, GROUP, params, seed=7)
    response = free.sequences[:, ids.shape[1]:]
    return sorted({int(response[0, 2]), int(response[4, 4])})


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # tp=2: 4 processes on 2 cores
def test_pipeline_rollout_equals_unsplit_rollout(tmp_path, tp):
    """Greedy and temperature-1 top-p sampling at pp=2 give `rollout`'s pp=1 output for the same seed, with stop
    tokens ending rows early; at tp=2 each stage decodes on its head shards and the sampled token is agreed."""
    make_causal_lm(tmp_path, "llama3_gqa", num_hidden_layers=4)
    dense = from_pretrained(tmp_path, vocab_pad_multiple=64).eval()
    ids, mask = left_padded(LENGTHS)
    cases = []
    for params in (SamplingParams(max_new_tokens=10, temperature=0.0, pad_token_id=PAD),
                   SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, pad_token_id=PAD)):
        stops = _stops(dense, ids, mask, params)
        params = SamplingParams(**{**params.__dict__, "eos_token_id": stops[0], "stop_token_ids": stops[1:]})
        ref, _ = rollout(dense, ids, mask, GROUP, params, seed=7)
        lengths = ref.attention_mask[:, ids.shape[1]:].sum(-1)
        assert int(lengths.min()) < params.max_new_tokens and len(set(lengths.tolist())) > 1  # rows end early, unevenly
        cases.append((params, 7, ref))
    run_distributed(_check, tmp_path, tp, ids, mask, cases, world_size=2 * tp)


def test_pipeline_rollout_rejects_unsupported_config(tmp_path):
    make_causal_lm(tmp_path, "llama3_gqa", num_hidden_layers=4)
    ids, mask = left_padded([3, 4])
    params = SamplingParams(max_new_tokens=2)
    run_distributed(_reject, tmp_path, ids, mask, params)


def _reject(path, ids, mask, params):
    layout = ParallelLayout.build(pp=2)
    stage = stage_from_pretrained(path, layout).eval()
    with pytest.raises(ValueError, match="max_batch"):
        pipeline_rollout(stage, ids, mask, 2, params, 0, layout, config=EngineConfig(max_batch=2))
    with pytest.raises(ValueError, match="pp_microbatches"):
        EngineConfig(pp_microbatches=-1)
