"""LoRA adapters (megalign.models.lora): gradients by hand, merge, adapters off, tp = 2 vs tp = 1, PEFT export.

References: the gradient of a LoRA layer is the dense weight gradient projected onto the adapters,
dW = dY^T X (per output / input feature), dB = s dW A^T, dA = s B^T dW (s = alpha / r), written out here;
PEFT (`peft.PeftModel.from_pretrained` on a `transformers` model) is the independent reference of the
exported adapter folder.
"""
import contextlib
import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models.hf_fixtures import VOCAB, make_causal_lm, random_ids
from parallel.dist_utils import run_distributed
from torch import nn
from torch.testing import assert_close

from conftest import TOL
from megalign.checkpoint.hf_export import export_hf, export_peft_adapter
from megalign.models import (LoRAConfig, adapters_disabled, apply_lora, from_pretrained, lora_modules, lora_state_dict,
                             merge_adapters, unmerge_adapters)
from megalign.models.lora import merged_base_view
from megalign.parallel import ParallelLayout
from megalign.parallel.layers import tp_sharded_parameters

FP32 = TOL[torch.float32]


class _Block(nn.Module):
    """One linear named like a decoder's (`q_proj`), so target selection finds it."""

    def __init__(self, in_features=5, out_features=3):
        super().__init__()
        self.q_proj = nn.Linear(in_features, out_features, bias=True)


def _randomise_adapters(model, seed=0):
    """B starts at zero; give it (and A) values so the adapters change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_state_dict(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_config_names_bad_values():
    with pytest.raises(ValueError, match="lora.rank"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="lora.alpha"):
        LoRAConfig(alpha=0)
    with pytest.raises(ValueError, match="lora.dropout"):
        LoRAConfig(dropout=1.0)
    with pytest.raises(ValueError, match=r"lora.target_modules: unknown names \['qproj'\]"):
        LoRAConfig(target_modules=["qproj"])
    assert LoRAConfig(target_modules="all-linear").modules() == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(ValueError, match="no module of the model is named"):
        apply_lora(nn.Sequential(nn.Linear(2, 2)), LoRAConfig(target_modules=["q_proj"]))


def test_init_is_peft_and_only_adapters_train():
    block = _Block(in_features=6)
    apply_lora(block, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj"]), seed=3)
    layer = block.q_proj
    assert [n for n, p in block.named_parameters() if p.requires_grad] == ["q_proj.lora_A", "q_proj.lora_B"]
    assert layer.lora_A.shape == (4, 6) and layer.lora_B.shape == (3, 4)
    assert (layer.lora_B == 0).all()
    bound = 1 / math.sqrt(6)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2/6), bound gain*sqrt(3/fan_in) = 1/sqrt(fan_in)
    assert layer.lora_A.abs().max() <= bound and layer.lora_A.abs().max() > 0.5 * bound
    again = _Block(in_features=6)
    apply_lora(again, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj"]), seed=3)
    assert torch.equal(again.q_proj.lora_A, layer.lora_A)  # seeded: the same draw every time


def test_gradient_is_dense_gradient_projected_onto_adapters():
    torch.manual_seed(0)
    block = _Block(in_features=5, out_features=3)
    apply_lora(block, LoRAConfig(rank=2, alpha=6, target_modules=["q_proj"]))
    _randomise_adapters(block)
    layer, s = block.q_proj, 6 / 2
    x = torch.randn(4, 5)
    dy = torch.randn(4, 3)  # upstream gradient: loss = sum(y * dy)
    y = layer(x)
    expected_y = x @ layer.weight.T + layer.bias + s * x @ layer.lora_A.T @ layer.lora_B.T
    assert_close(y, expected_y, **FP32)
    (y * dy).sum().backward()
    dw = dy.T @ x  # the dense layer's weight gradient [out, in]
    assert_close(layer.lora_B.grad, s * dw @ layer.lora_A.detach().T, **FP32)
    assert_close(layer.lora_A.grad, s * layer.lora_B.detach().T @ dw, **FP32)
    assert layer.weight.grad is None and layer.bias.grad is None  # the base is frozen


def test_merge_unmerge_and_adapters_off(tmp_path):
    make_causal_lm(tmp_path, "qwen2_tied")
    base = from_pretrained(tmp_path).eval()
    model = from_pretrained(tmp_path).eval()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules="all-linear"))
    _randomise_adapters(model)
    ids = random_ids(2, 7)
    with torch.no_grad():
        adapted, ref = model(ids), base(ids)
        assert (adapted - ref).abs().max() > 1e-3  # the adapters do something
        with adapters_disabled(model):
            assert torch.equal(model(ids), ref)  # off: exactly the base model
        assert torch.equal(model(ids), adapted)  # and back on
        weights = {n: p.clone() for n, p in model.named_parameters()}
        merge_adapters(model)
        assert_close(model(ids), adapted, **FP32)
        with pytest.raises(ValueError, match="merged"):
            with adapters_disabled(model):
                pass
        unmerge_adapters(model)
        for n, p in model.named_parameters():
            assert_close(p, weights[n], **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_cycles_restore_the_base_bit_for_bit(tmp_path, dtype):
    """W + sBA - sBA != W in floating point: unmerging by subtraction drifts the frozen base a little each cycle.
    After 20 merge / unmerge cycles (10 through `merged_base_view`, the export's path, 10 through
    `merge_adapters` / `unmerge_adapters`) every parameter is bitwise the original; merged, the weights are
    W + sBA within one rounding of an fp64 reference, and the merged model computes the adapted model's output."""
    make_causal_lm(tmp_path, "qwen2_tied")
    model = from_pretrained(tmp_path, dtype=dtype).eval()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules="all-linear"))
    _randomise_adapters(model)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers = lora_modules(model)
    ids = random_ids(2, 7)
    with torch.no_grad():
        adapted = model(ids).float()
    for cycle in range(20):
        if cycle % 2:
            merge_adapters(model)
            view = contextlib.nullcontext(model)
        else:
            view = merged_base_view(model)
        with view:
            if cycle < 2:
                with torch.no_grad():
                    assert_close(model(ids).float(), adapted, **TOL[dtype])
                for name, m in layers.items():  # merged: W + s B A (fp64) within one ulp of W's dtype
                    w, a, b = (original[f"{name}.{k}"].double() for k in ("weight", "lora_A", "lora_B"))
                    exact = (w + m.lora_scale * b @ a)
                    assert_close(m.weight.double(), exact, atol=1e-6, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6)
        if cycle % 2:
            unmerge_adapters(model)
        for n, p in model.named_parameters():
            assert torch.equal(p, original[n]), f"cycle {cycle}: {n} changed"
    assert not any(m.lora_merged for m in layers.values())


def test_merged_export_reloads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM
    make_causal_lm(tmp_path / "base", "llama_bias_mha")
    model = from_pretrained(tmp_path / "base").eval()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    _randomise_adapters(model)
    ids = random_ids(2, 7)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ours = model(ids)
    export_hf(model, tmp_path / "merged")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert_close(hf(ids).logits, ours, **FP32)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for n, p in before.items():  # the export restored the unmerged weights and the adapters
        assert_close(after[n], p, **FP32)
    assert not any(m.lora_merged for m in lora_modules(model).values())


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_loads_the_adapter_with_the_same_logits(tmp_path, use_rslora):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    make_causal_lm(tmp_path / "base", "qwen2_tied")
    model = from_pretrained(tmp_path / "base").eval()
    apply_lora(model, LoRAConfig(rank=4, alpha=16, target_modules="all-linear", use_rslora=use_rslora))
    scales = {m.lora_scale for m in model.modules() if hasattr(m, "lora_scale")}
    assert scales == {8.0 if use_rslora else 4.0}  # 16 / sqrt(4), 16 / 4
    _randomise_adapters(model)
    ids = random_ids(2, 9)
    with torch.no_grad():
        ours = model(ids)
    export_peft_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["use_rslora"] is use_rslora
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        base_logits = hf(ids).logits
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(ids).logits
    assert (theirs - base_logits).abs().max() > 1e-3  # PEFT applied the adapters
    assert_close(theirs, ours, **FP32)


def _all_gather(t, dim, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


class _CountCollectives:
    """Counts torch.distributed all_reduce / all_gather* calls within the block (test-side instrumentation)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")

    def __enter__(self):
        self.count, self.saved = 0, {n: getattr(dist, n) for n in self.NAMES}

        def counting(fn):
            def wrapped(*args, **kwargs):
                self.count += 1
                return fn(*args, **kwargs)
            return wrapped
        for n, fn in self.saved.items():
            setattr(dist, n, counting(fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


def _forward_collectives(model, ids):
    """How many collectives one forward of `model` calls."""
    with torch.no_grad(), _CountCollectives() as counter:
        model(ids)
    return counter.count


def _check_tp2(path, out):
    layout = ParallelLayout.build(tp=2)
    cfg = LoRAConfig(rank=4, alpha=8, target_modules="all-linear")
    dense = from_pretrained(path).train()
    model = from_pretrained(path, layout=layout).train()
    apply_lora(dense, cfg, seed=5)
    apply_lora(model, cfg, seed=5)
    sharded = tp_sharded_parameters(model)
    dense_lora = lora_state_dict(dense)
    for name, p in lora_state_dict(model).items():  # the same start at tp = 1 and tp = 2
        full = _all_gather(p.detach(), sharded[p], layout.tp_group) if p in sharded else p.detach()
        assert torch.equal(full, dense_lora[name]), name
    with torch.no_grad():  # move B off zero identically on both (the tp = 1 values, sliced)
        g = torch.Generator().manual_seed(1)
        for name, p in dense_lora.items():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, p in lora_state_dict(model).items():
            full = dense_lora[name]
            if p in sharded:
                dim = sharded[p]
                size = full.shape[dim] // 2
                full = full.narrow(dim, layout.tp_rank * size, size)
            p.copy_(full)
    ids = random_ids(2, 8)
    base_count = _forward_collectives(from_pretrained(path, layout=layout), ids)
    assert _forward_collectives(model, ids) == base_count > 0  # the adapters add no forward collective
    targets = ids[:, 1:].reshape(-1)
    ref_loss = F.cross_entropy(dense(ids)[:, :-1].reshape(-1, VOCAB), targets)
    ref_loss.backward()
    logits = model.lm_head.gather_logits(model(ids))[..., :VOCAB]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets)
    loss.backward()
    assert_close(loss, ref_loss, **FP32)
    for name, p in lora_state_dict(model).items():
        grad = _all_gather(p.grad, sharded[p], layout.tp_group) if p in sharded else p.grad
        assert_close(grad, dense_lora[name].grad, **FP32, msg=lambda m: f"{name}: {m}")
    assert all(p.grad is None for n, p in model.named_parameters() if n not in lora_state_dict(model))
    with torch.no_grad():  # adapters off at tp = 2 is the base model at tp = 2
        base = from_pretrained(path, layout=layout).eval()
        model.eval()
        with adapters_disabled(model):
            assert torch.equal(model(ids), base(ids))
    export_peft_adapter(model, out, str(path), layout)  # gathered at tp = 2: the tp = 1 export's tensors
    export_peft_adapter(dense, str(out) + "-tp1", str(path))  # collective (barrier): both ranks write the same files


def test_tp2_matches_tp1_and_exports_the_same_adapter(tmp_path):
    from safetensors.torch import load_file
    make_causal_lm(tmp_path / "base", "llama_bias_mha")
    run_distributed(_check_tp2, tmp_path / "base", tmp_path / "adapter")
    tp2 = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    tp1 = load_file(str(tmp_path / "adapter") + "-tp1/adapter_model.safetensors")
    assert tp2.keys() == tp1.keys() and len(tp1) == 2 * 7 * 2
    for k in tp1:
        assert_close(tp2[k], tp1[k], **FP32)
