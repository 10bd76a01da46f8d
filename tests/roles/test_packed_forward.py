"""The roles' response forwards: the fused LM head against a float64 full-softmax oracle and the eager
head, and packed rows against padded rows (log-probs, entropies, values and every gradient), at tp = 1
and tp = 2 on gloo."""
import json

import pytest
import torch
import torch.nn.functional as F
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy

import megalign.models.heads as heads_module
from megalign.models import from_pretrained, scalar_head_from_pretrained
from megalign.parallel import MixedPrecision, ParallelLayout, vocab_parallel_token_logprob
from megalign.roles import Actor, head_logprobs, response_logprobs, response_values
from megalign.trainers.online_config import ActorConfig
from megalign.roles.packing import _packs, pipeline_packs, response_hidden

VOCAB = 37  # odd: at tp = 2 the head has a padding row
PROMPT, RESPONSE = 6, 7


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("packed") / "policy", vocab_size=VOCAB)


def _rows():
    """[5, 13] left-padded prompts (lengths 6, 3, 1, 4, 6) then right-padded responses (7, 2, 5, 0, 1 tokens)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (5, PROMPT + RESPONSE), generator=g)
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate([(6, 7), (3, 2), (1, 5), (4, 0), (6, 1)]):
        mask[row, PROMPT - p:PROMPT + r] = 1
    ids[mask == 0] = 0  # pad id
    return ids, mask


def _oracle(model, hidden, targets, temperature):
    """float64 full-softmax log p(target) and entropy of lm_head(hidden) / temperature."""
    logits = F.linear(hidden.double(), model.lm_head.proj.weight.double())[..., :VOCAB] / temperature
    logp_all = logits.log_softmax(-1)
    return logp_all.gather(-1, targets[..., None])[..., 0], -(logp_all.exp() * logp_all).sum(-1)


def _weighted_loss(logp, entropy, real):
    """sum(u * logp + v * entropy) over real positions with fixed weights (both outputs get a gradient)."""
    g = torch.Generator().manual_seed(5)
    u, v = torch.randn(logp.shape, generator=g), torch.randn(logp.shape, generator=g)
    return ((u * logp.double() + v * entropy.double()) * real).sum()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _fused_vs_oracle_and_eager(policy, temperature):
    layout = ParallelLayout.build(tp=1, device_type="cpu")
    model = from_pretrained(policy)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (3, 5), generator=g)
    results = {}
    for name in ("fused", "eager", "oracle"):
        hidden.grad = None
        model.zero_grad()
        if name == "fused":
            logp, entropy = head_logprobs(model, layout, hidden, targets, temperature, with_entropy=True)
        elif name == "eager":  # the trainers' head before: logits, then the vocab-parallel log-prob
            logp, entropy = vocab_parallel_token_logprob(model.lm_head(hidden), targets, None, 0, temperature,
                                                         return_entropy=True, vocab_size=VOCAB)
        else:
            logp, entropy = _oracle(model, hidden, targets, temperature)
        _weighted_loss(logp, entropy, torch.ones(3, 5)).backward()
        results[name] = (logp.double(), entropy.double(), hidden.grad.double(),
                         model.lm_head.proj.weight.grad.double())
    for name in ("eager", "oracle"):
        for ours, ref in zip(results["fused"], results[name]):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_matches_float64_oracle_and_eager_head(policy, temperature):
    run_distributed(_fused_vs_oracle_and_eager, policy, temperature, world_size=1)


def _bf16_fused_vs_eager(policy):
    layout = ParallelLayout.build(tp=1, device_type="cpu")
    model = from_pretrained(policy)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 6, 32, generator=g)
    targets = torch.randint(0, VOCAB, (4, 6), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = head_logprobs(model, layout, hidden, targets, 1.0, with_entropy=True)
        eager = vocab_parallel_token_logprob(model.lm_head(hidden), targets, None, 0, return_entropy=True,
                                             vocab_size=VOCAB)
    oracle = _oracle(model, hidden, targets, 1.0)
    for ours, ref, exact in zip(fused, eager, oracle):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, rtol=0, atol=0.05)
        torch.testing.assert_close(ours.double(), exact, rtol=0, atol=0.05)


def _chunked_actor(policy, chunks):
    """The actor's log-probs, entropies and gradients with `head_chunk_tokens` = 1024 and 3 (5 * 7 response
    positions: 12 chunks); `chunks` records the chunk size each fused-head call got."""
    layout = ParallelLayout.build(tp=1, device_type="cpu")
    ids, mask = _rows()
    real = (mask[:, -RESPONSE:] == 1) & (mask[:, -RESPONSE - 1:-1] == 1)
    out = {}
    for chunk in (1024, 3):
        model = from_pretrained(policy)
        actor = Actor(model, layout, MixedPrecision(None), False, False, torch.optim.SGD(model.parameters(), lr=0.1),
                      None, head_chunk_tokens=chunk)
        logp, entropy = actor.logprobs_with_grad(ids, mask, RESPONSE, 0.8)
        _weighted_loss(logp, entropy, real).backward()
        torch.testing.assert_close(actor.logprobs(ids, mask, RESPONSE, 0.8), logp.detach())
        out[chunk] = logp[real], entropy[real], _grads(model)
    assert chunks == [1024, 1024, 3, 3]
    for a, b in zip(out[1024][:2], out[3][:2]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for name, grad in out[1024][2].items():
        torch.testing.assert_close(out[3][2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_actor_head_chunk_tokens_reach_the_fused_head(policy, monkeypatch):
    """`head_chunk_tokens` is the chunk of every actor head call (with and without gradient) and changes only the
    summation order; the actor config refuses chunks below one token."""
    chunks = []
    fused = heads_module.fused_linear_token_logprob

    def spy(hidden, weight, targets, group, vocab_start, chunk_size, *args, **kwargs):
        chunks.append(chunk_size)
        return fused(hidden, weight, targets, group, vocab_start, chunk_size, *args, **kwargs)

    monkeypatch.setattr(heads_module, "fused_linear_token_logprob", spy)
    run_distributed(_chunked_actor, policy, chunks, world_size=1)
    with pytest.raises(ValueError, match="actor.head_chunk_tokens must be >= 1, got 0"):
        ActorConfig(path="x", head_chunk_tokens=0)


def _packed_vs_padded(policy, layout, pack_tokens):
    """Packed and padded response forwards give the same log-probs, entropies and gradients at real tokens."""
    ids, mask = _rows()
    real = (mask[:, -RESPONSE:] == 1) & (mask[:, -RESPONSE - 1:-1] == 1)
    out = {}
    for pack in (False, True):
        model = from_pretrained(policy, layout=layout)
        logp, entropy = response_logprobs(model, layout, ids, mask, RESPONSE, 0.8, with_entropy=True, pack=pack,
                                          pack_tokens=pack_tokens)
        assert logp.shape == entropy.shape == (5, RESPONSE)
        assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
        _weighted_loss(logp, entropy, real).backward()
        out[pack] = logp[real], entropy[real], _grads(model), model
    for padded, packed in zip(out[False][:2], out[True][:2]):
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert out[True][2].keys() == out[False][2].keys() and len(out[True][2]) == len(list(model.parameters()))
    for name, grad in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    return out


def test_fused_head_under_bf16_autocast_matches_eager_head(policy):
    """bf16 compute: the fused and eager heads agree within bf16 rounding of the logits (|d logp| <= 0.05)."""
    run_distributed(_bf16_fused_vs_eager, policy, world_size=1)


def _packed_vs_padded_and_full_logits(policy, pack_tokens):
    layout = ParallelLayout.build(tp=1, device_type="cpu")
    out = _packed_vs_padded(policy, layout, pack_tokens)
    # and against the plain full-logits forward of the padded rows (the log-probs before this change)
    ids, mask = _rows()
    real = (mask[:, -RESPONSE:] == 1) & (mask[:, -RESPONSE - 1:-1] == 1)
    with torch.no_grad():
        logits = from_pretrained(policy)(ids, mask)[:, -RESPONSE - 1:-1].double() / 0.8
    expected = logits.log_softmax(-1).gather(-1, ids[:, -RESPONSE:, None])[..., 0][real]
    torch.testing.assert_close(out[True][0].double(), expected, rtol=1e-5, atol=1e-5)
    assert real.sum() == 7 + 2 + 5 + 0 + 1


@pytest.mark.parametrize("pack_tokens", [None, 8, 1000])
def test_packed_logprobs_equal_padded_and_full_logits(policy, pack_tokens):
    """None: packs of one padded row (13 tokens: 3 packs here), 8: one row per pack, 1000: one pack."""
    run_distributed(_packed_vs_padded_and_full_logits, policy, pack_tokens, world_size=1)


def _packed_values_vs_padded(policy):
    ids, mask = _rows()
    real = (mask[:, -RESPONSE:] == 1) & (mask[:, -RESPONSE - 1:-1] == 1)
    layout = ParallelLayout.build(tp=1, device_type="cpu")
    out = {}
    for pack in (False, True):
        model, _ = scalar_head_from_pretrained(policy, "value", layout, seed=0)
        values = response_values(model, ids, mask, RESPONSE, pack)
        with torch.no_grad():
            full = model.head(model.model(ids, mask))[:, -RESPONSE - 1:-1]  # every position, padded
        torch.testing.assert_close(values[real], full[real], rtol=1e-5, atol=1e-5)
        assert (values[~real] == 0).all()
        (values * real * torch.arange(1.0, RESPONSE + 1)).sum().backward()
        out[pack] = values[real], _grads(model)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    for name, grad in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packed_values_equal_padded(policy):
    run_distributed(_packed_values_vs_padded, policy, world_size=1)


def test_packing_positions_packs_and_bad_masks():
    # the trunk sees each row's real tokens with positions 0.. (the padded path's running count)
    ids, mask = _rows()
    seen = []

    def trunk(x, attention_mask=None, cu_seqlens=None):
        seen.append((x.clone(), cu_seqlens.clone()))
        return x[..., None].float()

    hidden, rows, cols = response_hidden(trunk, ids, mask, RESPONSE, pack=True, pack_tokens=1000)
    (packed, bounds), = seen
    assert bounds.tolist() == [0, 13, 18, 24, 28, 35]
    assert packed[0].tolist() == ids[mask == 1].tolist()
    # the hidden state predicting response token t is the real token before it
    assert hidden[:, 0].long().tolist() == ids[:, PROMPT - 1:-1][rows, cols].tolist()
    assert _packs([13, 5, 6, 4, 7], 13) == [(0, 1), (1, 3), (3, 5)]
    assert _packs([13, 5], 4) == [(0, 1), (1, 2)]  # a row longer than a pack gets its own
    # pack_max_fill: packed only while the real tokens (35) fill at most that fraction of the padded batch
    seen.clear()
    padded_calls = []

    def counting(x, attention_mask=None, cu_seqlens=None):
        if cu_seqlens is None:
            padded_calls.append(tuple(x.shape))
            return x[..., None].float()
        return trunk(x, cu_seqlens=cu_seqlens)

    fill = float(mask.sum()) / mask.numel()
    response_hidden(counting, ids, mask, RESPONSE, pack=True, pack_tokens=1000, pack_max_fill=fill)
    assert len(seen) == 1 and not padded_calls  # at the threshold: packed
    hidden_padded, rows_padded, cols_padded = response_hidden(counting, ids, mask, RESPONSE, pack=True,
                                                              pack_tokens=1000, pack_max_fill=fill - 0.01)
    assert len(seen) == 1 and padded_calls == [tuple(ids.shape)]  # fuller than allowed: one padded forward
    assert torch.equal(hidden_padded, hidden) and torch.equal(rows_padded, rows) and torch.equal(cols_padded, cols)
    gapped = mask.clone()
    gapped[0, 8] = 0
    with pytest.raises(ValueError, match="one run"):
        response_hidden(trunk, ids, gapped, RESPONSE, pack=True)
    with pytest.raises(ValueError, match="response_len"):
        response_hidden(trunk, ids, mask, PROMPT + RESPONSE, pack=True)


def _tp2_packed_equals_tp1(policy):
    layout = ParallelLayout.build(tp=2, device_type="cpu")
    out = _packed_vs_padded(policy, layout, None)
    single = ParallelLayout.build(tp=1, device_type="cpu")
    ids, mask = _rows()
    real = (mask[:, -RESPONSE:] == 1) & (mask[:, -RESPONSE - 1:-1] == 1)
    model = from_pretrained(policy)
    logp, entropy = response_logprobs(model, single, ids, mask, RESPONSE, 0.8, with_entropy=True)
    _weighted_loss(logp, entropy, real).backward()
    torch.testing.assert_close(out[True][0], logp[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[True][1], entropy[real], rtol=1e-5, atol=1e-5)
    head = out[True][3].lm_head
    full = model.lm_head.proj.weight.grad
    shard = torch.zeros(head.vocab_end - head.vocab_start, full.shape[1])
    rows = full[head.vocab_start:min(head.vocab_end, VOCAB)]
    shard[:len(rows)] = rows  # the padding row gets no gradient
    torch.testing.assert_close(head.proj.weight.grad, shard, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[True][3].model.norm.weight.grad, model.model.norm.weight.grad, rtol=1e-4, atol=1e-5)


def test_tensor_parallel_packed_equals_padded_and_single_device(policy):
    run_distributed(_tp2_packed_equals_tp1, policy)


def _trainers_packed_and_padded(policy, root):
    from trainers.grpo_helpers import tiny_config
    from trainers.test_ppo_trainer import tiny_ppo_config

    from megalign.trainers.grpo import train_grpo
    from megalign.trainers.ppo import train_ppo
    for pack in ("true", "false"):
        common = ("steps=1", "rollout.old_logprobs=recompute", "export_hf=false", f"rollout.pack={pack}",
                  "rollout.pack_max_fill=1.0")  # pack whatever the rows' fill
        train_grpo(tiny_config(policy, f"{root}/grpo_{pack}", "algo.kl_coef=0.05", *common))
        train_ppo(tiny_ppo_config(policy, f"{root}/ppo_{pack}", "algo.kl_coef=0.05", "algo.entropy_coef=0.01",
                                  *common))


@pytest.mark.slow  # four short trainer runs: about a minute on a loaded CPU
def test_trainer_steps_match_packed_and_padded(tmp_path):
    """One GRPO step (reference KL, recomputed old log-probs) and one PPO step (critic, entropy bonus): the same
    losses, KL, entropy, values and gradient norms with rollout.pack on and off."""
    policy = tiny_policy(tmp_path / "policy")
    run_distributed(_trainers_packed_and_padded, policy, str(tmp_path), world_size=1, timeout_s=300)
    for algo in ("grpo", "ppo"):
        rows = {}
        for pack in ("true", "false"):
            with open(tmp_path / f"{algo}_{pack}" / "metrics.jsonl") as f:
                row = [json.loads(line) for line in f if "reward/mean" in line][-1]
            rows[pack] = {k: v for k, v in row.items() if k.startswith(("actor/", "critic/", "reward/"))}
        assert rows["true"].keys() == rows["false"].keys() and "actor/grad_norm" in rows["true"]
        assert rows["true"] == pytest.approx(rows["false"], rel=1e-4, abs=1e-6), algo


@pytest.mark.parametrize("pack_tokens, min_packs", [(None, 2), (8, 7), (4, 1)])
def test_pipeline_packs_unpack_to_the_padded_forward(policy, pack_tokens, min_packs):
    """`pipeline_packs` (one pack a pipeline micro-batch, all padded to one length) and `PipelinePacks.unpack`: the
    trunk run on each pack with its boundaries, laid back into the rows, equals the padded forward at every real
    token (0 at padding), with the gradient to the padded forward's; a row longer than pack_tokens goes alone (the
    packs' length is then that row's), and packs are added (empty) up to `min_packs`."""
    model = from_pretrained(policy)
    ids, mask = _rows()
    packs = pipeline_packs(ids, mask, pack_tokens, min_packs)
    width = max(pack_tokens or ids.shape[1], int(mask.sum(1).max()))  # 13 at pack_tokens 4: the longest row
    filled = len(_packs(mask.sum(1).tolist(), width))
    assert packs.input_ids.shape == (max(min_packs, filled), width)
    assert torch.cat(packs.rows).tolist() == list(range(5))
    assert all(r.numel() for r in packs.rows[:filled]) and not any(r.numel() for r in packs.rows[filled:])
    padded = model.model(ids, mask)
    outputs = [model.model(packs.input_ids[i:i + 1], cu_seqlens=packs.cu_seqlens[i]) for i in range(len(packs.rows))]
    unpacked = torch.cat([packs.unpack(i, out) for i, out in enumerate(outputs)])
    real = mask.bool()
    torch.testing.assert_close(unpacked[real], padded[real], rtol=1e-5, atol=1e-5)
    assert unpacked[~real].abs().max() == 0
    weights = torch.randn(padded.shape)
    weight = model.model.layers[0].attn.q_proj.weight
    got = torch.autograd.grad((unpacked * weights)[real].sum(), weight)[0]
    want = torch.autograd.grad((padded * weights)[real].sum(), weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
