"""The rollout engine under bf16 autocast over fp32 weights, as the actor rolls out with `actor.dtype: bf16`: the KV
cache holds the compute dtype (bf16) although the keys come out of RoPE in fp32 and the values in bf16, every
engine configuration runs, and the recorded log-probs are those of a fresh forward under the same autocast; on a
GPU, the CUDA-graph replay of the static step gives the static eager step's tokens."""
import pytest
import torch
from models.hf_fixtures import make_causal_lm
from rollout_helpers import CONFIGS, PAD, fresh_log_softmax, left_padded

from megalign.models import from_pretrained
from megalign.rollout import EngineConfig, SamplingParams, rollout



@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    make_causal_lm(path, "qwen2_untied")
    return path


@pytest.fixture(scope="module")
def model(model_path):
    return from_pretrained(model_path).eval()


def test_kv_cache_takes_the_autocast_dtype(model):
    assert model.model.new_kv_cache(2, 8).k[0].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.model.new_kv_cache(2, 8).k[0].dtype == torch.bfloat16
        assert model.model.new_kv_cache(2, 8, slotted=True).v[0].dtype == torch.bfloat16
        assert model.model.new_kv_cache(2, 8, dtype=torch.float32).k[0].dtype == torch.float32


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rollout_under_autocast_matches_a_fresh_forward(model, name):
    ids, mask = left_padded([4, 8, 2], seed=3)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, eos_token_id=3, pad_token_id=PAD)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, stats = rollout(model, ids, mask, 3, params, seed=5, config=CONFIGS[name])
        fresh = fresh_log_softmax(model, out, 1.0)
    assert out.sequences.shape[0] == 9 and out.logprobs.dtype == torch.float32
    response = out.attention_mask[:, ids.shape[1]:].bool()
    assert stats.decode_tokens == int(response.sum())
    generated = out.sequences[:, ids.shape[1]:]
    expected = fresh.gather(-1, generated[..., None])[..., 0]
    # bf16 attention and matmuls on both sides, in different shapes (one query per step vs the whole sequence)
    torch.testing.assert_close(out.logprobs[response], expected[response], atol=0.1, rtol=0.05)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_under_autocast_equals_static_eager(model_path):
    model = from_pretrained(model_path).eval().cuda()
    ids, mask = (x.cuda() for x in left_padded([5, 3, 9, 6]))
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, eos_token_id=3, pad_token_id=PAD)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref, _ = rollout(model, ids, mask, 4, params, seed=2, config=EngineConfig(max_batch=6, static=True))
        out, stats = rollout(model, ids, mask, 4, params, seed=2,
                             config=EngineConfig(max_batch=6, static=True, cuda_graphs=True, sync_every=4))
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=0)
    assert stats.decode_tokens == int(ref.attention_mask[:, ids.shape[1]:].sum())
