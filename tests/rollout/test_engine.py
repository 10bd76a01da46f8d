"""The rollout engine (`megalign.rollout.rollout`) vs transformers `generate` and the simple loop (`generate`):
greedy tokens, log-probs vs a fresh forward, per-sample random streams that ignore batching and order, the
static decode step (traced whole by torch.compile, replayed from CUDA graphs on a GPU), tp=2 vs tp=1."""
import dataclasses

import pytest
import torch
from models.hf_fixtures import VOCAB, make_causal_lm
from parallel.dist_utils import run_distributed
from rollout_helpers import CONFIGS, PAD, fresh_log_softmax, left_padded
from transformers import GenerationConfig

from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rollout import EngineConfig, SamplingParams, generate, pick_tokens, rollout, stream_keys, stream_uniforms
from megalign.rollout.engine import _Rollout, splitmix64_mix



@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_causal_lm(path, "llama3_gqa")
    return path


@pytest.fixture(scope="module")
def model(model_path):
    return from_pretrained(model_path, vocab_pad_multiple=64).eval()  # 97 -> 128 rows: padding is never sampled


def _stop_tokens(hf, ids, mask):
    """(eos, [stop]) from an unconstrained greedy run, avoiding the first step, so rows stop mid-way."""
    config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=[], pad_token_id=PAD)
    with torch.no_grad():
        free = hf.generate(ids, attention_mask=mask, generation_config=config)
    width = ids.shape[1]
    first = set(free[:, width].tolist())
    eos = next(t for t in free[0, width + 1:].tolist() if t not in first)
    return eos, [t for t in free[2, width + 1:].tolist() if t not in first and t != eos][:1]


@pytest.mark.parametrize("family", ["llama3_gqa", "qwen2_untied", "mistral_window", "qwen3_tied"])
def test_greedy_equals_transformers_and_the_simple_loop(tmp_path, family):
    hf = make_causal_lm(tmp_path, family)
    ours = from_pretrained(tmp_path).eval()
    ids, mask = left_padded([3, 9, 6])
    eos, stop = _stop_tokens(hf, ids, mask)
    group = 2
    rep_ids, rep_mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    config = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=[eos, *stop], pad_token_id=PAD)
    with torch.no_grad():
        ref = hf.generate(rep_ids, attention_mask=rep_mask, generation_config=config)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_id=eos, stop_token_ids=stop, pad_token_id=PAD)
    loop = generate(ours, rep_ids, rep_mask, params)
    assert torch.equal(loop.sequences, ref)
    for name, engine in CONFIGS.items():
        out, stats = rollout(ours, ids, mask, group, params, config=engine)
        assert torch.equal(out.sequences, ref), name
        assert torch.equal(out.attention_mask, loop.attention_mask), name
        torch.testing.assert_close(out.logprobs, loop.logprobs, rtol=1e-5, atol=1e-5)
        assert stats.prefill_tokens == 3 + 9 + 6  # each prompt prefilled once, not G times
        assert stats.decode_tokens == int(loop.attention_mask[:, ids.shape[1]:].sum())
    assert (out.attention_mask[:, ids.shape[1]:] == 0).any()  # some row stopped early


def test_logprobs_equal_fresh_forward(model):
    ids, mask = left_padded([4, 8, 2], seed=5)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=5, top_p=0.9, eos_token_id=3)
    out, _ = rollout(model, ids, mask, 3, params, seed=11, config=CONFIGS["continuous_3"])
    response = out.attention_mask[:, ids.shape[1]:].bool()
    generated = out.sequences[:, ids.shape[1]:]
    fresh_all = fresh_log_softmax(model, out, 0.7)
    fresh = fresh_all.gather(-1, generated[..., None])[..., 0]
    torch.testing.assert_close(out.logprobs[response], fresh[response], atol=1e-5, rtol=1e-5)
    assert (out.logprobs[~response] == 0).all() and (generated[~response] == PAD).all()
    assert (generated < VOCAB).all()
    assert (fresh[response] >= fresh_all.topk(5).values[..., -1][response]).all()  # inside the top-k


def test_samples_do_not_depend_on_batching_or_order(model):
    ids, mask = left_padded([5, 3, 7, 2])
    params = SamplingParams(max_new_tokens=9, temperature=1.2, top_p=0.95, eos_token_id=5, stop_token_ids=range(6, 16),
                            pad_token_id=PAD)
    ref, _ = rollout(model, ids, mask, 3, params, seed=7)
    assert (ref.attention_mask[:, ids.shape[1]:] == 0).any()  # rows end at different steps
    for name, engine in CONFIGS.items():
        out, _ = rollout(model, ids, mask, 3, params, seed=7, config=engine)
        assert torch.equal(out.sequences, ref.sequences), name
        torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    order = [2, 0, 3, 1]
    shuffled, _ = rollout(model, ids[order], mask[order], 3, params, seed=7, prompt_keys=order,
                          config=CONFIGS["continuous_3"])
    assert torch.equal(shuffled.sequences.view(4, 3, -1), ref.sequences.view(4, 3, -1)[order])
    other, _ = rollout(model, ids, mask, 3, params, seed=8)
    assert not torch.equal(other.sequences, ref.sequences)
    # the G samples of a prompt are distinct draws
    assert not torch.equal(ref.sequences[0], ref.sequences[1])


def test_splitmix64_matches_the_published_sequence():
    # SplitMix64 seeded with 1234567 (Vigna's reference implementation, prng.di.unimi.it/splitmix64.c)
    published = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                 16408922859458223821]
    golden = 0x9E3779B97F4A7C15
    states = torch.tensor([(1234567 + k * golden) % 2**64 for k in range(1, 6)], dtype=torch.uint64).view(torch.int64)
    got = splitmix64_mix(states).view(torch.uint64)
    assert [int(v) for v in got.tolist()] == published


def test_stream_uniforms_follow_the_documented_formula():
    mask64, golden = 2**64 - 1, 0x9E3779B97F4A7C15

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask64
        return z ^ (z >> 31)

    def absorb(h, x):
        return mix((h + (x + 1) * golden) & mask64)

    seed, prompts, samples, steps = 12345, [0, 3, 3, 1000], [0, 0, 7, 2], [0, 5, 5, 255]
    keys = stream_keys(seed, torch.tensor(prompts), torch.tensor(samples))
    got = stream_uniforms(keys, torch.tensor(steps)).tolist()
    for p, g, s, u in zip(prompts, samples, steps, got):
        h = absorb(absorb(absorb(mix(seed), p), g), s)
        assert u == ((h >> 40) + 1) / 2**24
    assert all(0 < u <= 1 for u in got)


def test_inverse_cdf_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.0, float("-inf"), 0.0, -3.0]])
    n = 40000
    keys = stream_keys(3, torch.arange(n), torch.zeros(n, dtype=torch.long))
    u = stream_uniforms(keys, torch.zeros(n, dtype=torch.long))
    params = SamplingParams(max_new_tokens=1, temperature=1.0)
    tokens, logp = pick_tokens(logits.expand(n, -1), params, u)
    probs = logits.softmax(-1)[0]
    freq = torch.bincount(tokens, minlength=7).double() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert (freq - probs).abs().le(5 * sigma + 1e-12).all(), (freq, probs)
    assert freq[4] == 0  # -inf is never drawn
    torch.testing.assert_close(logp, probs.log()[tokens].float())
    top2, _ = pick_tokens(logits.expand(n, -1), SamplingParams(max_new_tokens=1, temperature=1.0, top_k=2), u)
    assert set(top2.tolist()) == {0, 3}


def _forced_lengths(lengths, eos):
    """A logits processor that makes output row r emit `eos` as its token number lengths[r] (and never before)."""
    lengths = torch.tensor(lengths)

    def processor(logits, rows, steps):
        force = (steps + 1 >= lengths.to(logits.device)[rows])[:, None]
        is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos
        return logits.masked_fill((force & ~is_eos) | (~force & is_eos), float("-inf"))
    return processor


def test_rows_end_at_forced_lengths_and_the_batch_refills(model):
    ids, mask = left_padded([6, 2, 4])
    lengths = [1, 7, 3, 12, 2, 5, 9, 4, 6, 8, 10, 11]  # U=3 x G=4 rows, some longer than the cap
    params = SamplingParams(max_new_tokens=10, temperature=1.0, eos_token_id=3, pad_token_id=PAD)
    processor = _forced_lengths(lengths, eos=3)
    ref = generate(model, ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0),
                   dataclasses.replace(params, temperature=0.0), logits_processor=processor)
    expected = [min(n, 10) for n in lengths]
    for name, engine in CONFIGS.items():
        out, stats = rollout(model, ids, mask, 4, params, seed=1, config=engine, logits_processor=processor)
        got = out.attention_mask[:, ids.shape[1]:].sum(-1).tolist()
        assert got == expected, name
        ends = out.sequences[:, ids.shape[1]:].gather(1, torch.tensor(expected)[:, None] - 1)[:, 0]
        assert [t == 3 for t in ends.tolist()] == [n <= 10 for n in lengths]
        assert stats.decode_tokens == sum(expected) and stats.prefill_tokens == 12
        greedy, _ = rollout(model, ids, mask, 4, dataclasses.replace(params, temperature=0.0), config=engine,
                            logits_processor=processor)
        assert torch.equal(greedy.sequences, ref.sequences), name
    # with 3 slots, 12 rows of mean length 5.4 take far fewer steps than 4 full rounds of 10
    _, stats = rollout(model, ids, mask, 4, params, config=CONFIGS["continuous_3"], logits_processor=processor)
    assert stats.decode_steps < 4 * 10


def test_static_step_traces_as_one_graph(model):
    """torch.compile(fullgraph=True) fails on any graph break, a host read (`.item()`, `.tolist()`) included."""
    ids, mask = left_padded([5, 3])
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=10, pad_token_id=PAD)
    engine = EngineConfig(static=True, sync_every=8)  # no check before the end: one batch size, one trace
    ref, _ = rollout(model, ids, mask, 2, params, seed=4, config=engine)
    state = _Rollout(model, ids, mask.long(), 2, params, 4, engine, torch.arange(2), None)
    state._step = torch.compile(state._step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = state.run()
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager(model_path):
    model = from_pretrained(model_path, vocab_pad_multiple=64).eval().cuda()
    ids, mask = (x.cuda() for x in left_padded([5, 3, 9, 6]))
    params = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, eos_token_id=3, pad_token_id=PAD)
    ref, _ = rollout(model, ids, mask, 4, params, seed=2, config=EngineConfig(max_batch=6))
    out, stats = rollout(model, ids, mask, 4, params, seed=2,
                         config=EngineConfig(max_batch=6, static=True, cuda_graphs=True, sync_every=4))
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=1e-4, atol=1e-4)
    assert stats.decode_tokens == int(ref.attention_mask[:, ids.shape[1]:].sum())


def test_bad_arguments_are_rejected(model):
    ids, mask = left_padded([5, 3])
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="left-padded"):
        rollout(model, ids, mask.flip(1), 2, params)
    with pytest.raises(ValueError, match="group_size"):
        rollout(model, ids, mask, 0, params)
    with pytest.raises(ValueError, match="prompt_keys"):
        rollout(model, ids, mask, 2, params, prompt_keys=[0])
    with pytest.raises(ValueError, match="cuda_graphs"):
        rollout(model, ids, mask, 2, params, config=EngineConfig(cuda_graphs=True))
    with pytest.raises(ValueError, match="max_batch"):
        EngineConfig(max_batch=-1)
    with pytest.raises(ValueError, match="sync_every"):
        EngineConfig(sync_every=0)


# ----- tensor parallelism

def _check_tp(path, ids, mask, refs):
    layout = ParallelLayout.build(tp=2)
    model = from_pretrained(path, layout=layout, vocab_pad_multiple=64).eval()  # kv heads and vocab sharded
    for (params, engine), ref in refs:
        out, _ = rollout(model, ids, mask, 3, params, seed=9 if layout.tp_rank == 0 else 123, config=engine)
        assert torch.equal(out.sequences, ref.sequences)  # tp rank 0's seed, the same schedule on both ranks
        torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)


def test_tp2_equals_tp1(model_path, model):
    ids, mask = left_padded([3, 8, 5])
    cases = [(SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_id=5, pad_token_id=PAD), CONFIGS["static_4"]),
             (SamplingParams(max_new_tokens=10, temperature=1.5, top_k=20, eos_token_id=5, pad_token_id=PAD),
              CONFIGS["continuous_3"])]
    refs = [(case, rollout(model, ids, mask, 3, case[0], seed=9, config=case[1])[0]) for case in cases]
    run_distributed(_check_tp, model_path, ids, mask, refs)


def test_engine_auto_resolves_per_device():
    """static / cuda_graphs default to auto: the static step with CUDA graphs on CUDA (measured 16x the eager
    step on an H200), the eager step on the CPU and in pipeline_rollout; explicit values are kept."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # device objects only, nothing allocated
    auto = EngineConfig()
    assert (auto.static, auto.cuda_graphs) == ("auto", "auto")
    assert (auto.resolved(cpu).static, auto.resolved(cpu).cuda_graphs) == (False, False)
    assert (auto.resolved(cuda).static, auto.resolved(cuda).cuda_graphs) == (True, True)
    assert (auto.resolved(cuda, pipelined=True).static, auto.resolved(cuda, pipelined=True).cuda_graphs) == (False, False)
    assert (auto.resolved(cuda, tp=2).static, auto.resolved(cuda, tp=2).cuda_graphs) == (True, False)
    assert EngineConfig(cuda_graphs=True).resolved(cuda, tp=2).cuda_graphs is True
    assert EngineConfig(static=True).resolved(cpu).static is True
    assert EngineConfig(cuda_graphs=False).resolved(cuda).cuda_graphs is False
    assert EngineConfig(static=False).resolved(cuda).cuda_graphs is False
    with pytest.raises(ValueError, match="static must be true, false or auto"):
        EngineConfig(static="yes")
