"""KV-cache generation vs transformers `generate`, and log-probs vs a fresh forward of the same model."""
import pytest
import torch
from models.hf_fixtures import VOCAB, make_causal_lm
from rollout_helpers import PAD, fresh_log_softmax as _fresh_log_softmax, left_padded as _left_padded
from transformers import GenerationConfig

from megalign.models import from_pretrained
from megalign.rollout import SamplingParams, generate


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_causal_lm(path, "llama3_gqa")
    return hf, from_pretrained(path, vocab_pad_multiple=64).eval()  # 97 -> 128 rows: padding must never be sampled


def _hf_greedy(hf, ids, mask, max_new, eos):
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=PAD)
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, generation_config=config)


@pytest.mark.parametrize("family", ["llama3_gqa", "qwen2_untied", "mistral_window", "qwen3_tied"])
def test_greedy_equals_transformers(tmp_path, family):
    hf = make_causal_lm(tmp_path, family)
    ours = from_pretrained(tmp_path).eval()
    ids, mask = _left_padded([3, 9, 6])
    # stop tokens picked from an unconstrained greedy run, avoiding the first step, so rows stop mid-way
    free = _hf_greedy(hf, ids, mask, 12, eos=[])
    first = set(free[:, 9].tolist())
    eos = next(t for t in free[0, 10:].tolist() if t not in first)
    stop = [t for t in free[2, 10:].tolist() if t not in first and t != eos][:1]
    ref = _hf_greedy(hf, ids, mask, 12, eos=[eos, *stop])
    out = generate(ours, ids, mask, SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_id=eos,
                                                   stop_token_ids=stop, pad_token_id=PAD))
    assert torch.equal(out.sequences, ref)
    # row 0 stopped early: either the batch ended sooner or row 0 was padded
    assert out.sequences.shape[1] < free.shape[1] or (out.attention_mask[0, 9:] == 0).any()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.9)])
def test_logprobs_equal_fresh_forward(models, top_k, top_p):
    _, ours = models
    ids, mask = _left_padded([4, 8, 2], seed=5)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=top_k, top_p=top_p, eos_token_id=3)
    out = generate(ours, ids, mask, params, torch.Generator().manual_seed(0))
    response = out.attention_mask[:, ids.shape[1]:].bool()
    generated = out.sequences[:, ids.shape[1]:]
    fresh_all = _fresh_log_softmax(ours, out, 0.7)
    fresh = fresh_all.gather(-1, generated[..., None])[..., 0]
    torch.testing.assert_close(out.logprobs[response], fresh[response], atol=1e-5, rtol=1e-5)
    assert (out.logprobs[~response] == 0).all() and (generated[~response] == PAD).all()
    assert (generated < VOCAB).all()
    if top_k:  # every sampled token lies in the top-k of the fresh distribution
        assert (fresh[response] >= fresh_all.topk(top_k).values[..., -1][response]).all()


def test_seeded_sampling_is_reproducible(models):
    _, ours = models
    ids, mask = _left_padded([5, 3])
    params = SamplingParams(max_new_tokens=8, temperature=1.3, top_p=0.95)
    a, b, c = (generate(ours, ids, mask, params, torch.Generator().manual_seed(s)) for s in (7, 7, 8))
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.sequences, c.sequences)


def test_top_k_one_is_greedy(models):
    _, ours = models
    ids, mask = _left_padded([5, 3])
    greedy = generate(ours, ids, mask, SamplingParams(max_new_tokens=6, temperature=0.0))
    top1 = generate(ours, ids, mask, SamplingParams(max_new_tokens=6, temperature=0.5, top_k=1),
                    torch.Generator().manual_seed(0))
    assert torch.equal(greedy.sequences, top1.sequences)


def test_bad_prompts_are_rejected(models):
    _, ours = models
    ids, mask = _left_padded([5, 3])
    with pytest.raises(ValueError, match="left-padded"):
        generate(ours, ids, mask.flip(1), SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(max_new_tokens=2, top_p=0.0)
