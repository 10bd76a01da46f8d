"""`sequence_logps` (the DPO / KTO summed response log-probs on the fused LM head, response positions only)
against transformers' LlamaForCausalLM on the same checkpoint, in float64.

Reference: sum over each row's response tokens of `log_softmax(hf_logits)[target]` (the summed
log-probs of DPO, Rafailov et al. eq. 7), and its gradient with respect to the LM head and the
embedding. The megalign model pads its vocabulary (`vocab_pad_multiple`), so the padding rows the
fused head leaves out are exercised too.
"""
import torch
from trainers.grpo_helpers import tiny_policy

from megalign.data import IGNORE_INDEX, ArithTaskConfig, CharTokenizer, collate_preferences, make_splits
from megalign.data.arith import preference_rows
from megalign.data.preference import PreferenceExample
from megalign.models import from_pretrained
from megalign.parallel import ParallelLayout
from megalign.roles.sequence_logps import PairBatch, sequence_logps


def _batch(tok: CharTokenizer, n: int) -> PairBatch:
    train, _ = make_splits(ArithTaskConfig(max_operand=9))
    examples = [PreferenceExample(tok.encode(r["prompt"], add_bos=True), tok.encode(r["chosen"]) + [tok.eos_id],
                                  tok.encode(r["rejected"]) + [tok.eos_id], r["margin"])
                for r in preference_rows(train[:n])]
    return PairBatch(**collate_preferences(examples, tok.pad_id))


def test_sequence_logps_equal_transformers_float64(tmp_path):
    from transformers import LlamaForCausalLM

    path = tiny_policy(tmp_path / "hf")
    tok = CharTokenizer()
    layout = ParallelLayout(tp=1, pp=1, dp=1, world_size=1)  # a plan: no process group needed at tp = 1
    model = from_pretrained(path, vocab_pad_multiple=64, dtype=torch.float64)
    assert model.config.padded_vocab_size > model.config.vocab_size
    hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
    batch = _batch(tok, 6)

    logps = sequence_logps(model, batch, layout)
    logps.pow(2).sum().backward()  # a non-uniform upstream gradient per row

    logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    mask = batch.targets != IGNORE_INDEX
    token = logits.log_softmax(-1).gather(-1, batch.targets.clamp(min=0)[..., None])[..., 0]
    expected = (token * mask).sum(-1)
    expected.pow(2).sum().backward()

    assert logps.dtype == torch.float64 and logps.shape == (12,)
    torch.testing.assert_close(logps, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(batch.response_lengths, mask.sum(-1))
    vocab = model.config.vocab_size
    torch.testing.assert_close(model.lm_head.proj.weight.grad[:vocab], hf.lm_head.weight.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(model.model.embed.weight.grad[:vocab], hf.model.embed_tokens.weight.grad,
                               rtol=1e-9, atol=1e-12)
    assert float(model.lm_head.proj.weight.grad[vocab:].abs().max()) == 0.0  # padding rows get no gradient
