"""MoE decoders (Qwen3-MoE, Mixtral) against transformers on tiny random checkpoints: logits, loss with the
load-balancing term, every gradient (fp32 tight, bf16 no worse than 2x transformers' own bf16 error), HF export
reloaded by transformers, tp = 2 and ep = 2 on gloo, and routing record / replay against a transformers router forced
to the same experts."""
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models.hf_fixtures import VOCAB, _randomise_norms, random_ids
from parallel.dist_utils import run_distributed
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.qwen3_moe import modeling_qwen3_moe

from conftest import TOL
from megalign.models import (CausalLM, LayerFactory, ModelConfig, from_pretrained, load_balancing_loss, moe_routing,
                             save_hf_checkpoint)
from megalign.models.hf_adapter import hf_rule
from megalign.models.moe import _grouped_mm_ok, routing_agreement
from megalign.parallel import ParallelLayout
from megalign.parallel.layers import tp_sharded_parameters

FP32 = TOL[torch.float32]
WIDTH = 16  # every expert's SwiGLU width: 64 bytes per fp32 row, 32 per bf16 row, 32 per fp32 row at tp = 2

_TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0, num_experts_per_tok=2,
             router_aux_loss_coef=0.02)
FAMILIES = {
    # layers 0 and 2 MoE, layer 1 dense (mlp_only_layers); k weights not renormalised; head_dim 16 != 32 / 4
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=6, moe_intermediate_size=WIDTH,
                                                              intermediate_size=48, head_dim=16, mlp_only_layers=[1],
                                                              norm_topk_prob=False)),
    # only layer 1 MoE (decoder_sparse_step 2), renormalised, tied embeddings
    "qwen3_moe_step2": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(num_experts=4, moe_intermediate_size=WIDTH,
                                                                    intermediate_size=48, decoder_sparse_step=2,
                                                                    norm_topk_prob=True, tie_word_embeddings=True)),
    # Qwen2's attention (q/k/v bias) and a shared expert beside the routed ones
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(num_experts=4, moe_intermediate_size=WIDTH,
                                                              intermediate_size=48,
                                                              shared_expert_intermediate_size=32)),
    # every layer MoE, always renormalised; a sliding window shorter than the sequence
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=5, intermediate_size=WIDTH,
                                                         sliding_window=6)),
}


def make_moe(path, family: str, seed: int = 0):
    """Save a random HF MoE causal LM in `path`; routers scaled up so the top-k is decided by wide margins."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = _randomise_norms(model_cls(cfg_cls(**{**_TINY, **extra})))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.eval().save_pretrained(path)
    return model


def hf_param(name: str, hf_tensors: dict) -> torch.Tensor:
    """transformers' tensor (a parameter or its gradient) for megalign parameter `name`: stacked experts are
    sliced out of transformers' fused `gate_up_proj` `[E, 2F, H]` (gate rows first) by hand."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(router\.weight|experts\.(gate|up|down)_proj)", name)
    if m is None:
        return hf_tensors[hf_rule(name)[0]]
    prefix = f"model.layers.{m[1]}.mlp."
    if m[2] == "router.weight":
        return hf_tensors[prefix + "gate.weight"]
    if m[3] == "down":
        return hf_tensors[prefix + "experts.down_proj"]
    gate_up = hf_tensors[prefix + "experts.gate_up_proj"]
    return gate_up[:, :WIDTH] if m[3] == "gate" else gate_up[:, WIDTH:]


def _batch():
    ids, mask = random_ids(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding: excluded from the loss and the load-balancing statistics
    return ids, mask


def _ce(logits, ids, mask):
    targets = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)


def _hf_run(hf, ids, mask, autocast: bool = False):
    """transformers' (logits, aux loss, CE + coef * aux, {name: grad}) on the batch; forward under CPU bf16
    autocast when `autocast`."""
    hf.zero_grad()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = hf(ids, attention_mask=mask, output_router_logits=True)
        loss = _ce(out.logits, ids, mask) + hf.config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    return out.logits.detach(), out.aux_loss.detach(), loss.detach(), grads


def _our_run(model, ids, mask, gather=lambda logits: logits, autocast: bool = False):
    with moe_routing(model, aux=True) as routing, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = gather(model(ids, attention_mask=mask))
        aux = load_balancing_loss(routing, model.config.num_experts)
        loss = _ce(logits[..., :VOCAB], ids, mask) + model.config.router_aux_loss_coef * aux
    loss.backward()
    return logits.detach()[..., :VOCAB], aux.detach(), loss.detach()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_loss_aux_and_grads_match_transformers(tmp_path, family):
    hf = make_moe(tmp_path, family).train()
    ids, mask = _batch()
    hf_logits, hf_aux, hf_loss, hf_grads = _hf_run(hf, ids, mask)
    model = from_pretrained(tmp_path, activation_checkpointing=family == "mixtral").train()  # recompute routes again
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "router")]
    assert len(moe) == {"qwen3_moe": 2, "qwen3_moe_step2": 1, "qwen2_moe": 3, "mixtral": 3}[family]
    assert _grouped_mm_ok(torch.ones(1, 32), moe[0].experts.down_proj)  # the grouped path, not the loop, is tested
    logits, aux, loss = _our_run(model, ids, mask)
    real = mask.bool()
    assert_close(logits[real], hf_logits[real], **FP32)
    assert_close(aux, hf_aux, **FP32)
    assert_close(loss, hf_loss, **FP32)
    for name, p in model.named_parameters():
        assert_close(p.grad, hf_param(name, hf_grads), atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_grouped_matmul_matches_per_expert_loop_in_float64():
    """fp32 `_grouped_mm` against the float64 loop over experts (the fallback), forward and both gradients,
    with an expert that receives no token."""
    from megalign.models.moe import grouped_linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=g, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3, 0, 4, 2])
    ends = counts.cumsum(0).to(torch.int32)
    up = torch.randn(9, 8, generator=g, dtype=torch.float64)
    ref = grouped_linear(x, w, counts, ends)  # float64: the loop
    (ref * up).sum().backward()
    ref_grads = x.grad.clone(), w.grad.clone()
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    assert _grouped_mm_ok(x32, w32)
    out = grouped_linear(x32, w32, counts, ends)
    out.sum().backward(retain_graph=True)  # a stride-0 gradient, which _grouped_mm's own backward refuses
    x32.grad, w32.grad = None, None
    (out * up.float()).sum().backward()
    assert_close(out.double(), ref, **FP32)
    assert_close(x32.grad.double(), ref_grads[0], **FP32)
    assert_close(w32.grad.double(), ref_grads[1], **FP32)
    assert (w32.grad[1] == 0).all()


def test_bf16_no_worse_than_transformers(tmp_path):
    hf = make_moe(tmp_path, "qwen3_moe").train()
    ids, mask = _batch()
    real = mask.bool()
    ref_logits, _, _, ref_grads = _hf_run(hf, ids, mask)
    hf_logits, _, _, hf_grads = _hf_run(hf.to(torch.bfloat16), ids, mask)
    model = from_pretrained(tmp_path, dtype=torch.bfloat16).train()
    logits, _, _ = _our_run(model, ids, mask)
    assert logits.dtype == torch.bfloat16
    _assert_no_worse_than_2x(model, logits[real], hf_logits[real], hf_grads, ref_logits[real], ref_grads)


def _assert_no_worse_than_2x(model, logits, hf_logits, hf_grads, ref_logits, ref_grads):
    """megalign's logits and gradients (`model`'s `.grad`) no further than 2x transformers' (`hf_*`) from the fp32
    reference (`ref_*`), in the 2-norm (the gradients' over every parameter)."""
    def err(a, b):
        return (a.double() - b.double()).norm().item()

    assert err(logits, ref_logits) <= 2 * err(hf_logits, ref_logits), (err(logits, ref_logits), err(hf_logits, ref_logits))
    ours = sum(err(p.grad, hf_param(n, ref_grads)) ** 2 for n, p in model.named_parameters()) ** 0.5
    theirs = sum(err(hf_param(n, hf_grads), hf_param(n, ref_grads)) ** 2 for n, _ in model.named_parameters()) ** 0.5
    assert ours <= 2 * theirs, (ours, theirs)


class _MatmulDtypes(TorchDispatchMode):
    """Records the operand dtypes of every `aten._grouped_mm` call below autocast (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._grouped_mm:
            self.calls.append(tuple(a.dtype for a in args[:2]))
        return func(*args, **(kwargs or {}))


def test_bf16_autocast_runs_experts_grouped_in_bf16_and_matches_transformers(tmp_path):
    """fp32 weights under CPU bf16 autocast (the trainers' precision): `torch._grouped_mm` is not on autocast's cast
    list, so the experts cast their operands themselves; every grouped matmul, forward and backward, then runs on
    bf16 operands (2 MoE layers x 3 projections x (1 forward + 2 backward) = 18 calls), and logits and every gradient
    are no further from the fp32 reference than 2x transformers' under the same autocast (its `eager` experts:
    `F.linear` per expert, which autocast runs in bf16; its `grouped_mm` experts would stay fp32)."""
    hf = make_moe(tmp_path, "qwen3_moe").train()
    ids, mask = _batch()
    real = mask.bool()
    ref_logits, _, _, ref_grads = _hf_run(hf, ids, mask)
    for layer in (0, 2):
        hf.model.layers[layer].mlp.experts.config._experts_implementation = "eager"
    hf_logits, _, _, hf_grads = _hf_run(hf, ids, mask, autocast=True)
    model = from_pretrained(tmp_path).train()
    with _MatmulDtypes() as seen:
        logits, _, _ = _our_run(model, ids, mask, autocast=True)
    assert seen.calls == [(torch.bfloat16, torch.bfloat16)] * 18, seen.calls
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # into the fp32 master weights
    _assert_no_worse_than_2x(model, logits[real], hf_logits[real], hf_grads, ref_logits[real], ref_grads)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_hf_export_reloads_in_transformers(tmp_path, family):
    make_moe(tmp_path / "in", family)
    model = from_pretrained(tmp_path / "in", vocab_pad_multiple=8).eval()
    with torch.no_grad():  # a trained model's experts differ from the checkpoint's
        model.model.layers[0].mlp.experts.up_proj.mul_(1.5)
    save_hf_checkpoint(model, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded).__name__ == FAMILIES[family][1].__name__
    assert reloaded.config.num_experts_per_tok == 2 and reloaded.config.router_aux_loss_coef == 0.02
    ids, mask = _batch()
    with torch.no_grad():
        assert_close(model(ids, attention_mask=mask)[..., :VOCAB][mask.bool()],
                     reloaded(ids, attention_mask=mask).logits[mask.bool()], **FP32)


def test_greedy_generation_and_rollout_match_transformers(tmp_path):
    """KV-cache decoding routes one token per row per step: the simple loop and the slot-cache engine both give
    transformers' greedy continuations."""
    from transformers import GenerationConfig

    from megalign.rollout import SamplingParams, generate, rollout

    hf = make_moe(tmp_path, "qwen3_moe")
    model = from_pretrained(tmp_path).eval()
    ids, mask = random_ids(3, 6, seed=5), torch.ones(3, 6, dtype=torch.long)
    ids[0, :2], mask[0, :2] = 0, 0
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=mask, generation_config=config)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, pad_token_id=0)
    assert torch.equal(generate(model, ids, mask, greedy).sequences, expected)
    assert torch.equal(rollout(model, ids, mask, 1, greedy)[0].sequences, expected)


# ----- routing record / replay

def _flip_router(model, ids, layer: int):
    """Move the router of MoE layer `layer` so that token 0 swaps its k-th and (k+1)-th experts; returns the moved
    row's expert. The (k+1)-th expert's router row gains (gap + 0.1) * x / |x|^2 for token 0's MLP input x."""
    mlp = model.model.layers[layer].mlp
    captured = {}
    handle = mlp.register_forward_pre_hook(
        lambda m, args: captured.setdefault("x", args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model(ids)
    handle.remove()
    x = captured["x"][0]
    with torch.no_grad():
        logits = mlp.router(x)
        top = torch.topk(logits, mlp.top_k + 1).indices
        gap = logits[top[-2]] - logits[top[-1]]
        mlp.router.weight[top[-1]] += (gap + 0.1) * x / x.dot(x)
    return int(top[-1])


def _hf_forced(hf, forced: dict):
    """transformers' Qwen3-MoE routers, each returning the given experts with its own probabilities at them
    (`forced`: HF router module -> [N, k] ids), as routing replay specifies."""
    original = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward

    def forward(self, hidden_states):
        logits, _, _ = original(self, hidden_states)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        ids = forced[self]
        weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids
    return forward


def test_routing_replay_keeps_recorded_experts_when_the_router_would_flip(tmp_path, monkeypatch):
    hf = make_moe(tmp_path, "qwen3_moe")
    model = from_pretrained(tmp_path).eval()
    ids = random_ids(1, 7)
    with torch.no_grad(), moe_routing(model, record=True) as rollout:
        rollout_logits = model(ids)
    assert sorted(rollout.chosen) == [0, 2] and rollout.chosen[0].shape == (7, 2)
    recorded = {layer: e.clone() for layer, e in rollout.chosen.items()}
    with torch.no_grad(), moe_routing(model, replay=recorded, record=True) as same:
        assert torch.equal(model(ids), rollout_logits)  # forcing the recorded experts reproduces the logits
    assert all(torch.equal(same.chosen[k], recorded[k]) for k in recorded)

    moved = _flip_router(model, ids, 0)  # the training-time router now disagrees on token 0 of layer 0
    with torch.no_grad(), moe_routing(model, record=True) as free:
        model(ids)
    assert moved in free.chosen[0][0] and moved not in recorded[0][0]
    flips = sum(int((~(free.chosen[k][:, :, None] == recorded[k][:, None]).any(-1)).sum()) for k in recorded)
    assert routing_agreement(recorded, free.chosen).item() == pytest.approx(1 - flips / (2 * 7 * 2))
    with torch.no_grad(), moe_routing(model, replay=recorded, record=True) as replayed:
        logits = model(ids)
    assert all(torch.equal(replayed.chosen[k], recorded[k]) for k in recorded)
    # reference: transformers with the same moved router, its routers forced to the recorded experts
    with torch.no_grad():
        hf.model.layers[0].mlp.gate.weight.copy_(model.model.layers[0].mlp.router.weight)
    forced = {hf.model.layers[0].mlp.gate: recorded[0], hf.model.layers[2].mlp.gate: recorded[2]}
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _hf_forced(hf, forced))
    with torch.no_grad():
        assert_close(logits, hf(ids).logits, **FP32)
    bad = {0: recorded[0][:3], 2: recorded[2]}
    with pytest.raises(ValueError, match=r"routing replay for layer 0 has shape \(3, 2\), expected \(7, 2\)"):
        with moe_routing(model, replay=bad):
            model(ids)


def test_pipeline_stages_keep_global_layer_indices(tmp_path):
    """Two stages (layers [0, 2) and [2, 3)) read their experts from the file by global index, chain to the whole
    model's logits, and key their routing records by global layer."""
    hf = make_moe(tmp_path, "qwen3_moe")
    first = from_pretrained(tmp_path, layer_range=(0, 2)).eval()
    last = from_pretrained(tmp_path, layer_range=(2, 3)).eval()
    ids = random_ids(2, 6)
    with torch.no_grad(), moe_routing(first, record=True) as r0, moe_routing(last, record=True) as r1:
        logits = last(first(ids))
        assert_close(logits[..., :VOCAB], hf(ids).logits, **FP32)
    assert (sorted(r0.chosen), sorted(r1.chosen)) == ([0], [2])


def test_rollout_records_every_step_and_training_replays_them(tmp_path):
    """Routing replay end to end: the experts recorded during KV-cache generation (prefill, then one step per
    token), assembled per sequence, are what a full training forward over the sequences chooses; after the router
    moves (a training update) the free forward disagrees, and replaying the record keeps the rollout's experts."""
    from megalign.rollout import SamplingParams, generate

    make_moe(tmp_path, "qwen3_moe")
    model = from_pretrained(tmp_path).eval()
    ids, mask = random_ids(2, 5, seed=9), torch.ones(2, 5, dtype=torch.long)
    ids[1, :2], mask[1, :2] = 0, 0
    with torch.no_grad(), moe_routing(model, record=True) as rollout:
        out = generate(model, ids, mask, SamplingParams(max_new_tokens=6, temperature=0.0, pad_token_id=0))
    assert len(rollout.steps) == 6 and rollout.steps[-1] is rollout.chosen  # prefill + 5 decode forwards
    recorded = {layer: torch.cat([rollout.steps[0][layer].view(2, 5, 2)]
                                 + [s[layer].view(2, 1, 2) for s in rollout.steps[1:]], 1).reshape(-1, 2)
                for layer in rollout.chosen}
    seqs, seq_mask = out.sequences[:, :-1], torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], 1)
    real = seq_mask.reshape(-1).bool()
    with torch.no_grad(), moe_routing(model, record=True) as train:
        model(seqs, attention_mask=seq_mask)
    assert routing_agreement(recorded, train.chosen, real).item() == 1.0
    _flip_router(model, seqs[:1, :1], 0)  # first token of row 0 (real): its layer-0 experts change
    with torch.no_grad(), moe_routing(model, record=True) as moved:
        model(seqs, attention_mask=seq_mask)
    assert routing_agreement(recorded, moved.chosen, real).item() < 1.0
    with torch.no_grad(), moe_routing(model, replay=recorded, record=True) as replayed:
        model(seqs, attention_mask=seq_mask)
    assert all(torch.equal(replayed.chosen[k], recorded[k]) for k in recorded)


def test_checkpoint_recompute_keeps_each_micro_batch_record(tmp_path):
    """Two micro-batches forward, then one backward: activation checkpointing recomputes the first one's layers
    after the second forward, and must not overwrite the second's record or statistics with the first's."""
    make_moe(tmp_path, "qwen3_moe")
    plain = from_pretrained(tmp_path).train()
    model = from_pretrained(tmp_path, activation_checkpointing=True).train()
    micro = [random_ids(1, 8, seed=s) for s in (11, 12)]
    with moe_routing(plain, record=True, aux=True) as ref:
        [plain(ids) for ids in micro]
        ref_aux = load_balancing_loss(ref, 6)
    with moe_routing(model, record=True, aux=True) as routing:
        sum(model(ids).sum() for ids in micro).backward()
        aux = load_balancing_loss(routing, 6)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(routing.steps, ref.steps) for k in a)
    assert routing.chosen is routing.steps[1] and not torch.equal(routing.steps[0][0], routing.steps[1][0])
    assert_close(aux, ref_aux, **FP32)  # the second micro-batch's, not the recomputed first's


def test_routing_agreement_by_hand():
    a = {0: torch.tensor([[0, 1], [2, 3], [1, 0]]), 3: torch.tensor([[4, 5], [4, 5], [4, 5]])}
    b = {0: torch.tensor([[1, 0], [2, 1], [3, 2]]), 3: torch.tensor([[4, 5], [5, 4], [0, 1]])}
    # layer 0: 2 + 1 + 0 shared of 6; layer 3: 2 + 2 + 0 of 6
    assert routing_agreement(a, b).item() == pytest.approx(7 / 12)
    # only tokens 0 and 1: 2 + 1 + 2 + 2 of 8
    assert routing_agreement(a, b, torch.tensor([True, True, False])).item() == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match=r"layers \[0, 3\] and \[0\] differ"):
        routing_agreement(a, {0: b[0]})


def test_config_reads_moe_keys_and_rejects_bad_ones():
    qwen = ModelConfig.from_hf(Qwen3MoeConfig(**_TINY, **FAMILIES["qwen3_moe"][2]).to_dict())
    assert (qwen.num_experts, qwen.moe_intermediate_size, qwen.norm_topk_prob, qwen.qk_norm) == (6, WIDTH, False, True)
    assert [qwen.is_moe_layer(i) for i in range(3)] == [True, False, True]
    hub = {**qwen.to_hf(), "num_experts": 6}
    hub.pop("num_local_experts", None)  # the hub's key
    assert ModelConfig.from_hf(hub).num_experts == 6
    mixtral = ModelConfig.from_hf(MixtralConfig(**_TINY, **FAMILIES["mixtral"][2]).to_dict())
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob, mixtral.sliding_window) == (
        5, WIDTH, True, 6)
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 is not supported"):
        ModelConfig.from_hf(MixtralConfig(**_TINY, **FAMILIES["mixtral"][2], router_jitter_noise=0.1).to_dict())
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=6\], got 7"):
        ModelConfig.from_hf({**qwen.to_hf(), "num_experts_per_tok": 7})
    with pytest.raises(ValueError,
                       match=r"^moe_intermediate_size \(16\) must be divisible by the tensor-parallel size 3$"):
        ModelConfig.from_hf({**qwen.to_hf(), "num_attention_heads": 6, "num_key_value_heads": 3,
                             "intermediate_size": 48}, vocab_pad_multiple=3).check_tensor_parallel(3)


# ----- tensor parallelism

def _whole_grad(p, sharded: dict, group) -> torch.Tensor:
    """`p`'s gradient, all-gathered over the tp group along its split dim when tp-sharded (test-side gather)."""
    if p not in sharded:
        return p.grad
    parts = [torch.empty_like(p.grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, p.grad.contiguous(), group=group)
    return torch.cat(parts, sharded[p])


def _check_tp2(path, ids, mask, hf_logits, hf_aux, hf_loss, hf_grads, hf_params):
    layout = ParallelLayout.build(tp=2)
    model = from_pretrained(path, layout=layout).train()
    logits, aux, loss = _our_run(model, ids, mask, gather=model.lm_head.gather_logits)
    real = mask.bool()
    assert_close(logits[real], hf_logits[real], **FP32)
    assert_close(aux, hf_aux, **FP32)
    assert_close(loss, hf_loss, **FP32)
    sharded = tp_sharded_parameters(model)
    assert model.model.layers[0].mlp.experts.gate_proj in sharded
    for name, p in model.named_parameters():
        grad = _whole_grad(p, sharded, layout.tp_group)
        expected = hf_param(name, hf_grads)
        assert_close(grad[:expected.shape[0]], expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    out = f"{path}/export"
    save_hf_checkpoint(model, out)
    dist.barrier()
    if layout.tp_rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        for name, p in reloaded.named_parameters():
            assert torch.equal(p, hf_params[name]), name


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_tp2_matches_transformers(tmp_path, family):
    hf = make_moe(tmp_path, family).train()
    ids, mask = _batch()
    hf_params = {n: p.detach().clone() for n, p in hf.named_parameters()}
    run_distributed(_check_tp2, str(tmp_path), ids, mask, *_hf_run(hf, ids, mask), hf_params)


# ----- expert parallelism: experts split over 2 data-parallel ranks, each with its own batch

class _ExpertParallel(LayerFactory):
    def __init__(self, size: int, rank: int = 0, group=None):
        self.ep_size, self.ep_rank, self.ep_group = size, rank, group


def _check_ep2(path, batches, hf_logits, hf_aux, hf_grads, hf_params):
    rank = dist.get_rank()
    model = from_pretrained(path, factory=_ExpertParallel(2, rank, dist.group.WORLD)).train()
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_proj.shape[0] == 3  # experts [3 * rank, 3 * rank + 3) of 6
    ids, mask = batches[rank]
    logits, aux, _ = _our_run(model, ids, mask)
    assert_close(logits[mask.bool()], hf_logits[rank][mask.bool()], **FP32)
    assert_close(aux, hf_aux[rank], **FP32)
    ep_marked = {getattr(m, n) for m in model.modules() for n in getattr(m, "ep_shard_dims", {})}
    for name, p in model.named_parameters():
        expected = hf_param(name, hf_grads)
        if p in ep_marked:  # this rank's experts saw both ranks' tokens: the gradient of the summed losses
            expected = expected[3 * rank:3 * rank + 3]
        else:  # replicated: the data-parallel sum
            dist.all_reduce(p.grad)
        assert_close(p.grad, expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    save_hf_checkpoint(model, f"{path}/export")
    dist.barrier()
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(f"{path}/export")
        for name, p in reloaded.named_parameters():
            assert torch.equal(p, hf_params[name]), name


def _hf_summed(hf, batches):
    """transformers' per-batch logits and aux losses, and the gradients of the batches' summed losses."""
    hf_logits, hf_aux, total = [], [], 0.0
    for ids, mask in batches:
        out = hf(ids, attention_mask=mask, output_router_logits=True)
        total = total + _ce(out.logits, ids, mask) + hf.config.router_aux_loss_coef * out.aux_loss
        hf_logits.append(out.logits.detach())
        hf_aux.append(out.aux_loss.detach())
    total.backward()
    return hf_logits, hf_aux, {n: p.grad.clone() for n, p in hf.named_parameters()}


def _two_batches():
    return [_batch(), (random_ids(2, 10, seed=7), torch.ones(2, 10, dtype=torch.long))]


def test_ep2_matches_transformers_on_the_summed_batches(tmp_path):
    hf = make_moe(tmp_path, "qwen3_moe").train()
    hf_params = {n: p.detach().clone() for n, p in hf.named_parameters()}
    batches = _two_batches()
    run_distributed(_check_ep2, str(tmp_path), batches, *_hf_summed(hf, batches), hf_params)


def test_ep_needs_experts_divisible():
    config = ModelConfig.from_hf(MixtralConfig(**_TINY, **FAMILIES["mixtral"][2]).to_dict())
    with pytest.raises(ValueError, match=r"^num_experts \(5\) must be divisible by the expert-parallel size 2$"):
        CausalLM(config, _ExpertParallel(2))


def _check_tp2_ep2(path, batches, hf_logits, hf_grads):
    from megalign.models import TensorParallelFactory

    layout = ParallelLayout.build(tp=2)  # 4 ranks: tp 2 x dp 2, the experts split over the dp group
    factory = TensorParallelFactory(layout)
    factory.ep_size, factory.ep_rank, factory.ep_group = layout.dp, layout.dp_rank, layout.dp_group
    model = from_pretrained(path, factory=factory, vocab_pad_multiple=2).train()
    assert model.model.layers[0].mlp.experts.gate_proj.shape == (3, WIDTH // 2, 32)
    ids, mask = batches[layout.dp_rank]
    logits, _, _ = _our_run(model, ids, mask, gather=model.lm_head.gather_logits)
    assert_close(logits[mask.bool()], hf_logits[layout.dp_rank][mask.bool()], **FP32)
    sharded = tp_sharded_parameters(model)
    ep_marked = {getattr(m, n) for m in model.modules() for n in getattr(m, "ep_shard_dims", {})}
    for name, p in model.named_parameters():
        grad = _whole_grad(p, sharded, layout.tp_group)
        expected = hf_param(name, hf_grads)
        if p in ep_marked:
            expected = expected[3 * layout.dp_rank:3 * layout.dp_rank + 3]
        else:
            dist.all_reduce(grad, group=layout.dp_group)
        assert_close(grad[:expected.shape[0]], expected, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_tp2_ep2_matches_transformers(tmp_path):
    """4 gloo ranks (tp 2 x ep 2 over dp 2): each expert sliced over tp and the experts split over dp."""
    hf = make_moe(tmp_path, "qwen3_moe").train()
    batches = _two_batches()
    hf_logits, _, hf_grads = _hf_summed(hf, batches)
    run_distributed(_check_tp2_ep2, str(tmp_path), batches, hf_logits, hf_grads, world_size=4)
