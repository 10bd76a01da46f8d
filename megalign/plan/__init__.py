"""Memory planner: per-rank bytes of every role in every phase of a run, before it is submitted.

    python -m megalign.plan --config examples/plan/grpo_llama3_70b.yaml          # a planner file
    python -m megalign.plan --run-config examples/grpo_arith.yaml --gpus 8 --model llama3-8b

Input (`PlanConfig`): a model (a preset of the published architectures in `megalign.plan.model.PRESETS`,
an HF config.json or a checkpoint folder), the GPUs and their memory, the algorithm, prompt and
response lengths, G, prompts per step, the micro-batch, and each role (actor, critic, reference,
reward model, and optionally a separate generation engine) with its tp, pp (and uneven stages:
first_stage_layers / last_stage_layers or stage_layers, as the trainers take them), dtype, state recipe,
ZeRO stage, offload switches, activation checkpointing and GPU pool. Or a megalign run config
(`megalign.plan.runconfig`), which takes what the trainer has. Output (`Estimate`): for every step of
a training step (rollout, scoring, update) and every pool, each role's weights, gradients, optimizer
state, activations, KV cache and loss-path logits on its worst pipeline stage, the peak phase and
whether it fits; a terminal table and JSON (`--json`). Exit status 0 fits, 1 does not, 2 bad input.

The model of memory (formulas and their sources in `megalign.plan.formulas`):
- Architecture: decoder-only Llama / Qwen2 / Qwen3 / Mistral as megalign builds them: grouped-query
  attention (num_key_value_heads kv heads of head_dim, k and v projections h x kv_heads * head_dim), a
  SwiGLU MLP of three h x intermediate_size matrices, RMSNorm gains (Qwen3's per-head q/k norms too),
  Qwen2's q/k/v biases, the vocabulary padded to a multiple of tp (lcm with vocab_pad_multiple), tied
  embeddings as one matrix at pp = 1 and a copy on the last stage at pp > 1. Parameter counts equal the published ones (tests/plan).
- Mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE's shared expert; `megalign.plan.model`): each MoE layer's
  router, E experts and shared expert counted per layer (dense layers where mlp_only_layers / decoder_sparse_step say);
  total and active parameters equal the model cards'. Expert parallelism the Megatron way (`RolePlan.ep`, expert
  tensor parallelism `etp`, and context parallelism `cp` for the peers' layouts): E / ep experts per rank, their
  states sharded over the expert data-parallel group GPUs / (etp ep pp), the rest over dp x cp; an MoE layer's
  activations are the SwiGLU of its k routed experts plus the router's and the dispatch's tensors
  (`formulas.moe_dispatch_bytes`), and ep > 1 adds one layer's all-to-all send / receive buffers (balanced routing:
  a dropless dispatcher's imbalance is not modelled). megalign's trainers run ep on their trained roles (actor.ep,
  critic.ep, model.ep, read by `plan_from_run_config`) with etp = tp, and no cp: a plan beyond that says so in its
  notes (`Estimate.notes`; `megalign.plan.planner`'s doc).
- LoRA (`RolePlan.lora`, the trainers' actor.lora / critic.lora): adapters counted per target linear and tp rank
  (`model.lora_layer_params`), gradients and optimizer state for the adapters only (and a critic's value head), the
  frozen base in the compute dtype (megalign: its fp32 master weights, whose bf16 autocast copies are saved per
  micro-batch in flight instead of cached); megalign's LoRA layers save less than full fine-tuning's (frozen
  weights keep no inputs, the adapters theirs and a rank-wide product: `formulas.megalign_lora_delta_bytes`, exact
  against saved-tensor hooks; a measured CPU LoRA step's peak within 1-10% of the plan); with actor.lora the reference is the actor with its adapters off: no
  weights of its own, the actor's kept in while it scores; the notes give the adapters' optimizer + gradient bytes
  against full fine-tuning's and the copy a separate reference would have held.
- Placement: megalign colocates roles: every role on every rank of its pool, one computing at a time;
  the others keep their parts on the device unless their offload switch is on (`Role.need`). Roles on
  other pools (OpenRLHF / NeMo-Aligner style) do not share memory. A phase's peak is its worst step.
- States per parameter: megalign's recipe is fp32 master weights + fp32 gradients + fp32 AdamW
  moments sharded by ZeRO-1 (4 + 4 + 8/d), plus a transient bf16 copy of every weight while a bf16
  role computes (autocast's cast cache); gradients exist only in the update (set to None after the
  step). The `megatron` and `zero` recipes follow Megatron-core's table and the ZeRO paper and keep
  persistent gradient buffers. Frozen roles hold their weights in their dtype.
- Activations (update): per layer, megalign's own count (fp32 residual stream and RMSNorm, one bf16
  cast per projection under autocast; checked against saved-tensor hooks on CPU) for the megalign
  recipe, the Korthikanti et al. 2022 count (generalised to SwiGLU / GQA / no dropout / flash) for the
  others; times the layers of the stage and the micro-batches 1F1B keeps in flight (pp - stage), so with
  uneven stages the worst stage is the one whose layers x in-flight micro-batches (and embedding or head)
  weigh most: the reason Megatron gives the first and last stages fewer layers;
  plus the token ids and RoPE tables on the first stage, the final norm and the head input on the last.
- Loss path: `loss_path: eager` (the default) applies the LM head and `vocab_parallel_token_logprob`:
  the [b, positions, V / tp] logits in the compute dtype and their gradient (positions: the R response
  tokens for the online trainers, every token for the supervised ones); `loss_path: fused`
  (`fused_linear_token_logprob`, which megalign's trainers use since issue 12) keeps one chunk instead.
- Scoring (no grad): the residual stream, a norm output and three SwiGLU intermediates of one layer,
  plus the logits of the micro-batch. Rollout: megalign's hybrid engine generates with the actor's
  own weights; its KV cache is 2 x layers x B x (P + R) x kv_heads / tp x head_dim in the weights'
  dtype (fp32 for megalign's actor), B = every sequence of the rank's share of the step at once; the
  prefill's live activations over B x P tokens; three [B, V] fp32 tensors of sampling. A separate
  engine (`generator`) may reserve a fraction of the GPU (vLLM's gpu_memory_utilization) while awake.
- A separate engine whose reservation (memory_fraction) cannot hold its weights and prefill leaves no KV cache:
  vLLM refuses to start, so the plan does not fit whatever its peak (`Estimate.problems`).
- Not modelled: allocator fragmentation and the CUDA context (leave headroom), communication buffers,
  the activations of a scoring pass beyond one layer, CPU memory of offloaded parts.
Validated in tests/plan: the formula tables reproduce exactly; small CPU runs at tp = 1 / 2 and
pp = 1 / 2 peak within 15% of the prediction (measured 2-6%); the anchors' published 70B layouts fit
and half as many GPUs per replica do not; NeMo-RL's Qwen3-30B-A3B (32 H100) and Qwen3-235B-A22B (128 H100)
GRPO layouts and verl's LoRA Qwen2.5-72B GRPO on 8 x 80 GB fit, the 235B layout cannot be placed on 64 GPUs and
the LoRA run does not fit on 4 (tests/plan/test_plan_moe_lora.py).
"""
from megalign.plan.formulas import korthikanti_layer_bytes, megalign_layer_bytes, state_bytes_per_param
from megalign.plan.model import PRESETS, active_params, load_model, lora_layer_params, stage_params, total_params
from megalign.plan.planner import Estimate, PlanConfig, Planner, RolePlan, plan_memory
from megalign.plan.runconfig import plan_from_run_config

__all__ = ["PlanConfig", "RolePlan", "Planner", "Estimate", "plan_memory", "plan_from_run_config", "PRESETS",
           "load_model", "stage_params", "total_params", "active_params", "lora_layer_params",
           "korthikanti_layer_bytes", "megalign_layer_bytes", "state_bytes_per_param"]
