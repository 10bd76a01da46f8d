"""LoRA vs full fine-tuning: bytes of optimizer state and of parameter gradients after one training step (issue 30).

Model: a small Llama-shaped decoder built from scratch (default hidden 512, 8 layers, SwiGLU 1408, 8 query /
4 key-value heads, vocabulary 32000, untied head), fp32, one gloo rank (tp = dp = 1). Each peer runs one
step of the trainers' code path: `apply_lora` (for the LoRA peers), `megalign.trainers.optim.build_optimizer`
(ZeRO-1 AdamW over the parameters that require grad), a forward on 4 x 128 random tokens, next-token cross
entropy, backward, `step()`. Then it counts exact bytes (not RSS): every tensor of the optimizer's state
(AdamW's exp_avg, exp_avg_sq, step) and every `.grad`. Peers: full fine-tuning; LoRA rank 8 and 16 on
all linears (`all-linear`), and rank 8 on q_proj / v_proj only (PEFT's default). The reference-copy
column is what a DPO / KTO / GRPO run with a separate frozen reference holds beside the policy (the
parameter bytes); with LoRA the reference is the policy with its adapters off, so it holds none.
Target (issue 30): LoRA's optimizer + gradient bytes <= 10% of full fine-tuning's.

Run from the repository root: `PYTHONPATH=. python benchmarks/bench_lora.py [--hidden 512 --layers 8]`.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from harness import machine_line  # noqa: E402

from megalign.models import CausalLM, LoRAConfig, ModelConfig, apply_lora  # noqa: E402
from megalign.parallel import ParallelLayout  # noqa: E402
from megalign.trainers.optim import OptimConfig, build_optimizer  # noqa: E402

PEERS = {"full fine-tuning": None,
         "LoRA r=8, all-linear": LoRAConfig(rank=8, alpha=16, target_modules="all-linear"),
         "LoRA r=16, all-linear": LoRAConfig(rank=16, alpha=32, target_modules="all-linear"),
         "LoRA r=8, q_proj + v_proj": LoRAConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])}


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def one_step(config: ModelConfig, lora, layout: ParallelLayout) -> dict[str, int]:
    """{trainable, params, optimizer, grads}: counts and bytes after one step of one peer (module doc)."""
    torch.manual_seed(0)
    model = CausalLM(config).train()
    if lora is not None:
        apply_lora(model, lora, seed=0)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4), layout)
    ids = torch.randint(0, config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    optimizer.step()
    local = getattr(optimizer, "optim", optimizer)  # ZeRO-1's local AdamW holds the state
    return {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "params": _bytes(model.parameters()),
            "optimizer": _bytes(t for state in local.state.values() for t in state.values()),
            "grads": _bytes(p.grad for p in model.parameters() if p.grad is not None)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        layout = ParallelLayout.build(tp=1)
        config = ModelConfig(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                             intermediate_size=args.intermediate, num_hidden_layers=args.layers, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=args.hidden // 8, max_position_embeddings=256)
        results = {name: one_step(config, lora, layout) for name, lora in PEERS.items()}
        dist.destroy_process_group()
    full = results["full fine-tuning"]
    mib = 2 ** 20
    print(f"decoder H={args.hidden}, {args.layers} layers, SwiGLU {args.intermediate}, V={args.vocab}, fp32: "
          f"{full['trainable'] / 1e6:.1f} M parameters ({full['params'] / mib:.0f} MiB)")
    print("| peer | trainable params | optimizer state MiB | gradients MiB | optimizer + gradients | vs full | "
          "reference copy MiB |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        both = r["optimizer"] + r["grads"]
        ref = 0 if PEERS[name] is not None else full["params"]
        print(f"| {name} | {r['trainable']:,} | {r['optimizer'] / mib:.2f} | {r['grads'] / mib:.2f} | "
              f"{both / mib:.2f} MiB | {100 * both / (full['optimizer'] + full['grads']):.2f}% | {ref / mib:.0f} |")


if __name__ == "__main__":
    main()
