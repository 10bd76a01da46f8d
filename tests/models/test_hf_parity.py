"""megalign's decoder vs transformers on tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints (fp32, tight)."""
import pytest
import torch
import torch.nn.functional as F
from models.hf_fixtures import FAMILIES, VOCAB, make_causal_lm, random_ids

from conftest import TOL
from megalign.models import from_pretrained

FP32 = TOL[torch.float32]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    hf = make_causal_lm(tmp_path, family)
    ours = from_pretrained(tmp_path).eval()
    ids = random_ids(2, 21)  # longer than mistral's window of 8 and llama3's original context of 16
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, **FP32)


def _per_sequence_reference(hf, seqs):
    with torch.no_grad():
        return [hf(s[None]).logits[0] for s in seqs]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_unpadded(tmp_path, side):
    hf = make_causal_lm(tmp_path, "llama3_gqa")
    ours = from_pretrained(tmp_path).eval()
    lengths = [7, 12, 1]
    seqs = [random_ids(1, n, seed=i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[row, cols], mask[row, cols] = s, 1
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask)
    assert torch.isfinite(logits).all()  # padding queries must not produce NaN
    for row, ref in enumerate(_per_sequence_reference(hf, seqs)):
        torch.testing.assert_close(logits[row][mask[row].bool()], ref, **FP32)


@pytest.mark.parametrize("family", ["llama3_gqa", "mistral_window", "qwen3_untied"])
def test_packed_batch_equals_unpadded(tmp_path, family):
    hf = make_causal_lm(tmp_path, family)
    ours = from_pretrained(tmp_path).eval()
    lengths = [5, 11, 1, 9]
    seqs = [random_ids(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    with torch.no_grad():
        logits = ours(torch.cat(seqs)[None], cu_seqlens=cu_seqlens)[0]
    for doc, ref in enumerate(_per_sequence_reference(hf, seqs)):
        torch.testing.assert_close(logits[cu_seqlens[doc]:cu_seqlens[doc + 1]], ref, **FP32)


def test_packed_rejects_bad_boundaries(tmp_path):
    make_causal_lm(tmp_path, "llama3_gqa")
    ours = from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"packed length 6.*\[0, 2, 5\]"):
        ours(random_ids(1, 6), cu_seqlens=torch.tensor([0, 2, 5]))


@pytest.mark.parametrize("family,checkpointing", [("qwen2_tied", False), ("llama3_gqa", True), ("qwen3_tied", False),
                                                  ("qwen3_untied", True)])
def test_gradients_match_transformers(tmp_path, family, checkpointing):
    hf = make_causal_lm(tmp_path, family).train()
    ours = from_pretrained(tmp_path, activation_checkpointing=checkpointing).train()
    ids, mask = random_ids(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding in one row

    def loss_of(logits):
        # next-token cross entropy on real tokens only
        targets = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)

    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # HF needs them given for left padding
    loss_of(hf(ids, attention_mask=mask, position_ids=position_ids).logits).backward()
    loss_of(ours(ids, attention_mask=mask)).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    from megalign.models.hf_adapter import hf_rule
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[hf_rule(name)[0]], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
