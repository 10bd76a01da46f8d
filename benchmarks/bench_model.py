"""megalign's decoder vs transformers on the same small Llama (same weights, same CPU threads), side by side.

    python benchmarks/bench_model.py [--quick]

Cases: forward+backward of a next-token loss (training step without the optimizer; cross entropy
on both models, plus megalign with the loss through its token_logprob kernel, as its trainers
compute it), and greedy
generation with a KV cache (transformers `generate(do_sample=False)`, forced to the same length with
min_new_tokens). Model: 4 layers, hidden 512, 8 heads / 4 kv heads, vocab 32000, fp32. The case label
carries the token count, so tokens/s = tokens / time.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import Row, format_table, median_times_interleaved  # noqa: E402

from megalign.models import from_pretrained  # noqa: E402
from megalign.ops import token_logprob  # noqa: E402
from megalign.rollout import SamplingParams, generate  # noqa: E402

VOCAB = 32000


def _models(tmp: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)
    hf = LlamaForCausalLM(config)
    hf.save_pretrained(tmp)
    return hf, from_pretrained(tmp)


def _cross_entropy(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _token_logprob_loss(logits, ids):
    """The same next-token loss through megalign's kernel: -mean log p(next token)."""
    return -token_logprob(logits[:, :-1], ids[:, 1:]).mean()


def _train_step(model, ids, logits_of, loss_fn=_cross_entropy):
    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(logits_of(model(ids)), ids).backward()
    return step


def run(quick: bool) -> list:
    batch, seq = (2, 64) if quick else (4, 512)
    gen_batch, prompt, new = (2, 8, 8) if quick else (4, 64, 128)
    repeats = 2 if quick else 5
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = _models(tmp)
        hf.train(), ours.train()
        ids = torch.randint(0, VOCAB, (batch, seq))
        case = f"B={batch} T={seq} ({batch * seq} tok)"
        times = median_times_interleaved({
            "megalign": _train_step(ours, ids, lambda x: x),
            "megalign + token_logprob loss": _train_step(ours, ids, lambda x: x, _token_logprob_loss),
            "transformers": _train_step(hf, ids, lambda out: out.logits),
        }, repeats)
        rows += [Row("fwd+bwd", case, impl, t) for impl, t in times.items()]

        hf.eval(), ours.eval()
        prompts = torch.randint(1, VOCAB, (gen_batch, prompt))
        mask = torch.ones_like(prompts)
        params = SamplingParams(max_new_tokens=new, temperature=0.0)
        hf_config = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        case = f"B={gen_batch} prompt={prompt} new={new} ({gen_batch * new} tok)"

        def hf_generate():
            with torch.no_grad():
                return hf.generate(prompts, attention_mask=mask, generation_config=hf_config)

        times = median_times_interleaved({
            "megalign": lambda: generate(ours, prompts, mask, params),
            "transformers": hf_generate,
        }, repeats)
        rows += [Row("generate", case, impl, t) for impl, t in times.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(format_table(run(args.quick)))


if __name__ == "__main__":
    main()
