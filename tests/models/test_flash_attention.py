"""The flash-attn path of the decoder's attention (megalign.models.attention).

flash-attn needs a GPU, so on CPU these tests install a stand-in `flash_attn` module whose
`flash_attn_func` / `flash_attn_varlen_func` are a slow, literal reading of flash-attn 2's documented
semantics (loop over sequences and heads, explicit causal and window mask, softmax) that also asserts
the argument contract the real kernels enforce (int32 cu_seqlens, contiguous `[total, h, D]`, kv heads
dividing q heads, one dtype). `flash_kernel_supports` is patched to say yes on CPU so the rest of the
real selection (KV cache, gaps under a window, MEGALIGN_ATTENTION) still runs. The flash path is then
checked against transformers (logits and every gradient) and against the SDPA path. The last test runs
the real flash-attn on a GPU when one and the package are present.
"""
import sys
import types

import pytest
import torch
from models.hf_fixtures import VOCAB, make_causal_lm, random_ids

from conftest import TOL, requires_cuda
from megalign.models import attention, from_pretrained
from megalign.models.hf_adapter import hf_rule

FP32 = TOL[torch.float32]
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)  # as test_hf_parity's gradient check


def _reference_sequence(q, k, v, softmax_scale, window):
    """One sequence as flash-attn 2 documents it: q `[T, h, D]`, k/v `[S, h_kv, D]` -> `[T, h, D]`.

    Causal aligned to the bottom right: query i sits at key index i + S - T and sees keys j with
    i + S - T - window[0] <= j <= i + S - T (window[0] = -1: no left bound). Query head n reads kv head
    n // (h / h_kv). Softmax in fp32, output in q's dtype.
    """
    t, h, _ = q.shape
    s, h_kv, _ = k.shape
    q_at = torch.arange(t, device=q.device)[:, None] + s - t
    j = torch.arange(s, device=q.device)[None, :]
    allowed = j <= q_at
    if window[0] >= 0:
        allowed = allowed & (j >= q_at - window[0])
    heads = []
    for n in range(h):
        kv = n // (h // h_kv)
        scores = (q[:, n].float() @ k[:, kv].float().T) * softmax_scale
        heads.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[:, kv].float())
    return torch.stack(heads, dim=1).to(q.dtype)


def _check_common(q, k, v, dropout_p, softmax_scale, causal, window_size):
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert k.shape == v.shape and q.shape[-1] == k.shape[-1], (q.shape, k.shape, v.shape)
    assert q.shape[-2] % k.shape[-2] == 0, f"kv heads {k.shape[-2]} must divide q heads {q.shape[-2]}"
    assert all(x.stride(-1) == 1 for x in (q, k, v))
    assert dropout_p == 0.0 and causal is True and isinstance(softmax_scale, float)
    assert isinstance(window_size, tuple) and len(window_size) == 2 and window_size[1] in (-1, 0), window_size


def _check_cu_seqlens(cu, max_seqlen, total, device):
    assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == device, (cu.dtype, cu.shape, cu.device)
    bounds = cu.tolist()
    assert bounds[0] == 0 and bounds[-1] == total and bounds == sorted(bounds), bounds
    assert isinstance(max_seqlen, int) and max_seqlen == max(b - a for a, b in zip(bounds, bounds[1:]))
    return bounds


def make_fake_flash_attn() -> types.ModuleType:
    """A `flash_attn` module computing `_reference_sequence`; `calls` records (function name, q dtype)."""
    fake = types.ModuleType("flash_attn")
    fake.calls = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
        _check_common(q, k, v, dropout_p, softmax_scale, causal, window_size)
        assert q.dim() == 4 and q.shape[:2] == k.shape[:2], (q.shape, k.shape)  # (batch, seqlen, nheads, headdim)
        fake.calls.append(("flash_attn_func", q.dtype))
        return torch.stack([_reference_sequence(q[b], k[b], v[b], softmax_scale, window_size)
                            for b in range(q.shape[0])])

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1)):
        _check_common(q, k, v, dropout_p, softmax_scale, causal, window_size)
        assert q.dim() == 3 and all(x.is_contiguous() for x in (q, k, v)), "want contiguous (total, nheads, headdim)"
        bq = _check_cu_seqlens(cu_seqlens_q, max_seqlen_q, q.shape[0], q.device)
        bk = _check_cu_seqlens(cu_seqlens_k, max_seqlen_k, k.shape[0], q.device)
        assert len(bq) == len(bk)
        fake.calls.append(("flash_attn_varlen_func", q.dtype))
        return torch.cat([_reference_sequence(q[a:b], k[c:d], v[c:d], softmax_scale, window_size)
                          for a, b, c, d in zip(bq, bq[1:], bk, bk[1:])])

    fake.flash_attn_func = flash_attn_func
    fake.flash_attn_varlen_func = flash_attn_varlen_func
    return fake


@pytest.fixture
def fake_flash(monkeypatch):
    """The stand-in `flash_attn` installed in sys.modules (MEGALIGN_ATTENTION=auto)."""
    fake = make_fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setenv(attention.ATTENTION_ENV, "auto")
    attention.flash_attn_module.cache_clear()
    yield fake
    attention.flash_attn_module.cache_clear()


@pytest.fixture
def flash_on_cpu(fake_flash, monkeypatch):
    """`fake_flash`, and the kernel-support check answering yes for CPU and fp32 too."""
    monkeypatch.setattr(attention, "flash_kernel_supports", lambda device, dtype, head_dim: True)
    return fake_flash


# ------------------------------------------------------------------ batches

def _sequences(lengths, seed):
    return [random_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]


def make_batch(layout: str, seqs):
    """(forward kwargs, spans): spans[i] indexes sequence i's tokens in the model's `[B, T, ...]` output."""
    if layout == "packed":
        bounds = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
        spans = [(0, slice(int(a), int(b))) for a, b in zip(bounds, bounds[1:])]
        return dict(input_ids=torch.cat(seqs)[None], cu_seqlens=bounds), spans
    width = max(len(s) for s in seqs) + (2 if layout == "gap" else 0)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    spans = []
    for row, s in enumerate(seqs):
        start = {"left": width - len(s), "right": 0, "unpadded": 0, "gap": 0}[layout]
        cols = slice(start, start + len(s))
        ids[row, cols], mask[row, cols] = s, 1
        spans.append((row, cols))
    if layout == "gap":  # a hole of padding inside row 0: real tokens at columns [0, 3) and [5, len + 2)
        ids[0], mask[0] = 0, 0
        ids[0, :3], ids[0, 5:5 + len(seqs[0]) - 3] = seqs[0][:3], seqs[0][3:]
        mask[0, :3], mask[0, 5:5 + len(seqs[0]) - 3] = 1, 1
        spans[0] = (0, mask[0].bool())
    if layout == "unpadded":
        return dict(input_ids=ids), spans
    return dict(input_ids=ids, attention_mask=mask), spans


LENGTHS = {"unpadded": [13, 13], "left": [13, 9, 1], "right": [13, 9, 1], "packed": [5, 13, 1, 9]}


def _loss(per_seq_logits, weights):
    """A fixed random linear functional of every real token's logits: its gradient reaches every position."""
    return sum((logits * w).sum() for logits, w in zip(per_seq_logits, weights))


def ours_logits_and_grads(model, kwargs, spans, weights):
    model.zero_grad()
    logits = model(**kwargs)
    per_seq = [logits[row, cols] for row, cols in spans]
    _loss(per_seq, weights).backward()
    return [x.detach() for x in per_seq], {n: p.grad.clone() for n, p in model.named_parameters()}


def hf_logits_and_grads(hf, seqs, weights):
    """transformers on each sequence alone (no padding or packing involved), gradients summed over them."""
    hf.zero_grad()
    per_seq = [hf(s[None]).logits[0] for s in seqs]
    _loss(per_seq, weights).backward()
    return [x.detach() for x in per_seq], {n: p.grad for n, p in hf.named_parameters()}


def _assert_grads(ours, ref, to_ref_name=lambda n: n):
    for name, grad in ours.items():
        torch.testing.assert_close(grad, ref[to_ref_name(name)], **GRAD_TOL, msg=lambda m: f"{name}: {m}")


CASES = [(family, layout, False) for family in ("llama3_gqa", "llama_bias_mha", "mistral_window")
         for layout in ("unpadded", "left", "right", "packed")]
CASES += [("mistral_window", "left", True), ("llama3_gqa", "packed", True)]


@pytest.mark.parametrize("family,layout,checkpointing", CASES)
def test_flash_path_matches_transformers_and_sdpa(tmp_path, flash_on_cpu, monkeypatch, family, layout,
                                                 checkpointing):
    """Logits and every gradient: flash path == transformers per sequence, and == the SDPA path."""
    hf = make_causal_lm(tmp_path, family).train()
    ours = from_pretrained(tmp_path, activation_checkpointing=checkpointing).train()
    seqs = _sequences(LENGTHS[layout], seed=20)
    kwargs, spans = make_batch(layout, seqs)
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(len(s), VOCAB, generator=g) for s in seqs]

    flash_logits, flash_grads = ours_logits_and_grads(ours, kwargs, spans, weights)
    expected_fn = "flash_attn_func" if layout == "unpadded" else "flash_attn_varlen_func"
    n_layers = ours.config.num_hidden_layers * (2 if checkpointing else 1)  # recomputed in backward
    assert flash_on_cpu.calls == [(expected_fn, torch.float32)] * n_layers

    hf_logits, hf_grads = hf_logits_and_grads(hf, seqs, weights)
    for ours_seq, ref in zip(flash_logits, hf_logits):
        torch.testing.assert_close(ours_seq, ref, **FP32)
    _assert_grads(flash_grads, hf_grads, lambda n: hf_rule(n)[0])

    monkeypatch.setenv(attention.ATTENTION_ENV, "sdpa")
    flash_on_cpu.calls.clear()
    sdpa_logits, sdpa_grads = ours_logits_and_grads(ours, kwargs, spans, weights)
    assert flash_on_cpu.calls == []
    for a, b in zip(flash_logits, sdpa_logits):
        torch.testing.assert_close(a, b, **FP32)
    _assert_grads(flash_grads, sdpa_grads)


def test_flash_right_padding_gives_finite_logits_everywhere(tmp_path, flash_on_cpu):
    """Padding positions get zero attention output from the scatter, so their logits are finite, never NaN: each is
    the pad token's embedding through the residual MLP blocks alone (o_proj has no bias), written out on
    transformers' modules."""
    hf = make_causal_lm(tmp_path, "llama3_gqa")
    ours = from_pretrained(tmp_path).eval()
    kwargs, _ = make_batch("right", _sequences([6, 2], seed=5))
    with torch.no_grad():
        logits = ours(**kwargs)
        assert not hf.config.attention_bias
        h = hf.model.embed_tokens(torch.tensor([0]))
        for layer in hf.model.layers:
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        want = hf.lm_head(hf.model.norm(h))[0]
    padding = kwargs["attention_mask"] == 0
    assert int(padding.sum()) == 4  # row 1's positions 2-5
    torch.testing.assert_close(logits[padding], want.expand(4, -1), **FP32)


def test_gap_in_padding_without_window_uses_flash(tmp_path, flash_on_cpu):
    """A hole inside a row: varlen over the real tokens equals transformers on the sequence alone."""
    hf = make_causal_lm(tmp_path, "llama3_gqa")
    ours = from_pretrained(tmp_path).eval()
    seqs = _sequences([9, 4], seed=30)
    kwargs, spans = make_batch("gap", seqs)
    with torch.no_grad():
        logits = ours(**kwargs)
        refs = [hf(s[None]).logits[0] for s in seqs]
    assert {fn for fn, _ in flash_on_cpu.calls} == {"flash_attn_varlen_func"}
    for (row, cols), ref in zip(spans, refs):
        torch.testing.assert_close(logits[row, cols], ref, **FP32)


def test_gap_in_padding_with_window_stays_on_sdpa(tmp_path, flash_on_cpu):
    """A window measures slot distances (padding included, as transformers' SDPA does); flash would not."""
    make_causal_lm(tmp_path, "mistral_window")
    ours = from_pretrained(tmp_path).eval()
    kwargs, _ = make_batch("gap", _sequences([12, 4], seed=31))
    with torch.no_grad():
        ours(**kwargs)
    assert flash_on_cpu.calls == []


def test_kv_cache_decoding_stays_on_sdpa(tmp_path, flash_on_cpu):
    make_causal_lm(tmp_path, "llama3_gqa")
    ours = from_pretrained(tmp_path).eval()
    kwargs, _ = make_batch("left", _sequences([5, 3], seed=40))
    cache = ours.model.new_kv_cache(batch=2, max_len=8)
    with torch.no_grad():
        ours(**kwargs, kv_cache=cache)
    assert flash_on_cpu.calls == []


def test_autocast_bf16_feeds_flash_bf16_and_is_no_worse_than_sdpa(tmp_path, flash_on_cpu, monkeypatch):
    """Under autocast RoPE's fp32 tables promote q/k to fp32; flash must still get the autocast dtype.
    bf16 error against fp32 transformers: flash no worse than 2x SDPA's in the same dtype."""
    hf = make_causal_lm(tmp_path, "mistral_window")
    ours = from_pretrained(tmp_path).eval()
    seqs = _sequences([13, 9, 1], seed=50)
    kwargs, spans = make_batch("left", seqs)

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = ours(**kwargs).float()
        return [logits[row, cols] for row, cols in spans]

    flash = run()
    assert flash_on_cpu.calls == [("flash_attn_varlen_func", torch.bfloat16)] * ours.config.num_hidden_layers
    monkeypatch.setenv(attention.ATTENTION_ENV, "sdpa")
    sdpa = run()
    with torch.no_grad():
        refs = [hf(s[None]).logits[0] for s in seqs]
    flash_err = max((a - r).abs().max() for a, r in zip(flash, refs))
    sdpa_err = max((a - r).abs().max() for a, r in zip(sdpa, refs))
    assert flash_err <= 2 * sdpa_err + 1e-3, (flash_err, sdpa_err)


# ------------------------------------------------------------------ backend selection

CUDA = torch.device("cuda")  # a device object only; nothing is allocated on it


def _batch(key_valid=None, sliding_window=None, has_kv_cache=False):
    t = 6 if key_valid is None else key_valid.shape[1]
    return attention.AttentionBatch(t, t, key_valid, None, None, sliding_window, has_kv_cache, torch.device("cpu"))


LEFT_PADDED = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
WITH_GAP = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key_valid,window", [(None, None), (None, 4), (LEFT_PADDED, 4), (WITH_GAP, None)])
def test_select_flash_on_gpu_half_precision(fake_flash, dtype, key_valid, window):
    assert attention.select_backend(CUDA, dtype, 128, _batch(key_valid, window)) == "flash"


@pytest.mark.parametrize("device,dtype,head_dim,batch", [
    (torch.device("cpu"), torch.bfloat16, 64, _batch()),  # no flash kernels on CPU
    (CUDA, torch.float32, 64, _batch()),  # flash-attn 2 has fp16/bf16 kernels only
    (CUDA, torch.bfloat16, 64, _batch(has_kv_cache=True)),  # decoding keeps SDPA
    (CUDA, torch.bfloat16, 512, _batch()),  # head size above flash-attn 2's 256
    (CUDA, torch.bfloat16, 64, _batch(WITH_GAP, sliding_window=4)),  # window over a gap: slot distances differ
], ids=["cpu", "fp32", "kv_cache", "head_dim_512", "gap_with_window"])
def test_select_sdpa(fake_flash, device, dtype, head_dim, batch):
    assert attention.select_backend(device, dtype, head_dim, batch) == "sdpa"


def test_select_sdpa_when_flash_attn_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` raise ImportError
    attention.flash_attn_module.cache_clear()
    try:
        assert attention.select_backend(CUDA, torch.bfloat16, 64, _batch()) == "sdpa"
    finally:
        attention.flash_attn_module.cache_clear()


def test_env_forces_sdpa_and_rejects_unknown_values(fake_flash, monkeypatch):
    monkeypatch.setenv(attention.ATTENTION_ENV, "sdpa")
    assert attention.select_backend(CUDA, torch.bfloat16, 64, _batch()) == "sdpa"
    monkeypatch.setenv(attention.ATTENTION_ENV, "flash3")
    with pytest.raises(ValueError, match="MEGALIGN_ATTENTION='flash3'"):
        attention.select_backend(CUDA, torch.bfloat16, 64, _batch())


def test_varlen_layout_of_left_and_right_padding():
    """Hand-worked: rows [0 0 1 1 1 1] and [1 1 0 0 0 0] -> tokens 2..5 and 6..7, cu_seqlens [0, 4, 6]."""
    valid = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    layout = _batch(valid).varlen
    assert layout.indices.tolist() == [2, 3, 4, 5, 6, 7]
    assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens.tolist() == [0, 4, 6]
    assert layout.max_seqlen == 4 and layout.gapless
    assert not _batch(WITH_GAP).varlen.gapless


# ------------------------------------------------------------------ the real kernel

@requires_cuda
@pytest.mark.parametrize("family", ["llama3_gqa", "mistral_window"])
@pytest.mark.parametrize("layout", ["unpadded", "left", "right", "packed"])
def test_real_flash_attn_matches_sdpa_on_gpu(tmp_path, monkeypatch, family, layout):
    """bf16 on a GPU: flash-attn's logits and gradients against fp32 SDPA no worse than 2x bf16 SDPA's."""
    flash_attn = pytest.importorskip("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    attention.flash_attn_module.cache_clear()
    make_causal_lm(tmp_path, family, max_position_embeddings=512)
    seqs = _sequences({"unpadded": [300, 300], "left": [300, 170, 1], "right": [300, 170, 1],
                       "packed": [70, 300, 1, 129]}[layout], seed=60)
    kwargs, spans = make_batch(layout, seqs)
    kwargs = {k: v.cuda() for k, v in kwargs.items()}
    g = torch.Generator().manual_seed(4)
    weights = [torch.randn(len(s), VOCAB, generator=g).cuda() for s in seqs]

    def run(mode, dtype):
        monkeypatch.setenv(attention.ATTENTION_ENV, mode)
        model = from_pretrained(tmp_path).to("cuda", dtype).train()
        logits, grads = ours_logits_and_grads(model, kwargs, spans, [w.to(dtype) for w in weights])
        return torch.cat([x.float() for x in logits]), {n: x.float() for n, x in grads.items()}

    ref_logits, ref_grads = run("sdpa", torch.float32)
    sdpa_logits, sdpa_grads = run("sdpa", torch.bfloat16)
    calls = []
    real_varlen, real_func = flash_attn.flash_attn_varlen_func, flash_attn.flash_attn_func
    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", lambda *a, **k: calls.append(1) or real_varlen(*a, **k))
    monkeypatch.setattr(flash_attn, "flash_attn_func", lambda *a, **k: calls.append(1) or real_func(*a, **k))
    flash_logits, flash_grads = run("auto", torch.bfloat16)
    assert calls, "the flash path did not run"
    assert (flash_logits - ref_logits).abs().max() <= 2 * (sdpa_logits - ref_logits).abs().max() + 1e-2
    for name, ref in ref_grads.items():
        flash_err = (flash_grads[name] - ref).abs().max()
        sdpa_err = (sdpa_grads[name] - ref).abs().max()
        assert flash_err <= 2 * sdpa_err + 1e-2 * ref.abs().max(), (name, flash_err, sdpa_err)
    attention.flash_attn_module.cache_clear()
