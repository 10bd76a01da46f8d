"""The plan: a run's roles and batch, and the bytes each rank holds in each phase (module doc of `megalign.plan`).

Expert parallelism (`RolePlan.ep`) and context parallelism (`RolePlan.cp`) are planned the Megatron way so that
the peers' published MoE layouts can be judged. megalign's trainers run ep on their trained roles (`actor.ep`,
`critic.ep`, the supervised `model.ep`: experts split over ep consecutive dp ranks, each expert sliced by tp, i.e.
etp = tp), which `plan_from_run_config` reads; they have no cp, no expert tp other than tp, and no ep on a frozen
role. The planner accepts those too and says so in the estimate's notes (`Estimate.notes`) instead of refusing: a
plan with them describes a peer's run, not a megalign one.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from megalign.config import option
from megalign.models.config import ModelConfig
from megalign.models.lora import LoRAConfig
from megalign.parallel.layout import StageSplit
from megalign.plan.estimate import PARTS, Bytes, Estimate, Step, StepBytes, role_dp  # noqa: F401 (re-exported)
from megalign.plan.formulas import (CAST_COPY_BYTES, MEGALIGN, MEGATRON, MEGATRON_BF16_GRADS, ZERO, ceil_div, gib,
                                    korthikanti_layer_bytes, megalign_layer_bytes, megalign_lora_delta_bytes,
                                    moe_dispatch_bytes, pipeline_in_flight, state_bytes_per_param)
from megalign.plan.model import layer_params, load_model, padded_vocab, stage_params
from megalign.plan.notes import plan_notes

ROLES = ("actor", "critic", "reference", "reward", "generator")
TRAINED = ("actor", "critic")
ALGORITHMS = ("grpo", "ppo", "sft", "dpo", "kto", "rm")


@dataclasses.dataclass
class RolePlan:
    """How one role is placed and stored; every role of a run has its own."""

    tp: int = option(1, doc="tensor-parallel size")
    pp: int = option(1, doc="pipeline-parallel size (1F1B for training)")
    first_stage_layers: Optional[int] = option(None, doc="pp > 1: decoder layers of the first stage (Megatron's --decoder-first-pipeline-num-layers); the middle stages split the rest evenly")
    last_stage_layers: Optional[int] = option(None, doc="pp > 1: decoder layers of the last stage (Megatron's --decoder-last-pipeline-num-layers)")
    stage_layers: Optional[list[int]] = option(None, doc="pp > 1: decoder layers of every stage (pp entries summing to the model's layers); instead of first / last")
    cp: int = option(1, doc="context-parallel size (Megatron's context_parallel_size, verl's Ulysses sequence parallelism): a rank "
                            "holds 1/cp of each sequence's tokens; weights replicated, dp = GPUs / (tp pp cp), states "
                            "sharded over dp x cp; megalign's trainers: 1 (module doc)")
    ep: int = option(1, doc="MoE: expert-parallel size (Megatron's expert_model_parallel_size): E / ep experts per rank, their states "
                            "sharded over the expert data-parallel group GPUs / (etp ep pp); megalign's trainers: the "
                            "trained roles' ep (actor.ep, critic.ep, model.ep; module doc)")
    etp: Optional[int] = option(None, doc="MoE: expert tensor-parallel size (Megatron's expert_tensor_parallel_size); null: tp, "
                                          "as megalign slices every expert by tp")
    lora: Optional[LoRAConfig] = option(None, doc="trained roles: LoRA adapters {rank, target_modules, ...} as the trainers' actor.lora / "
                                                  "critic.lora: base frozen, adapters trained; with actor.lora the reference is "
                                                  "the actor with adapters off (no copy of the weights)")
    dtype: Literal["fp32", "bf16"] = option(
        "bf16", doc="compute dtype of trained roles (megalign: bf16 autocast over fp32 master weights); frozen roles: the weights' dtype")
    recipe: Literal["megalign", "megatron", "zero"] = option(
        "megalign", doc="trained roles' bytes per parameter: megalign (4 + 4 + 8 fp32), megatron (its distributed-optimizer table), zero (ZeRO paper, 2 + 2 + 12)")
    main_grads: Literal["fp32", "bf16"] = option("fp32", doc="megatron recipe: main-gradient dtype (bf16: grad_reduce_in_fp32 false)")
    zero_stage: int = option(1, doc="0: replicated states; 1: optimizer sharded over dp (ZeRO-1, Megatron's distributed optimizer); 2: and gradients; 3: and weights")
    offload_weights: bool = option(False, doc="weights on host in the steps that do not use them (megalign's Role.need, NeMo's CPU offload, vLLM sleep)")
    offload_optimizer: bool = option(False, doc="optimizer state on host outside this role's update")
    cpu_optimizer: bool = option(False, doc="ZeRO-Offload: fp32 master weights, Adam state and the step on host; the device keeps 16-bit weights and gradients")
    activation_checkpointing: Literal["none", "selective", "full"] = option("none", doc="recompute in backward: selective (attention scores) or full (whole layers)")
    sequence_parallel: bool = option(False, doc="Megatron sequence parallelism (splits the replicated activations by tp)")
    pool: str = option("main", doc="the GPUs this role lives on (a key of `pools`); roles of one pool share each rank's memory")
    memory_fraction: Optional[float] = option(
        None, doc="generator: fraction of GPU memory the engine reserves while awake (vLLM's gpu_memory_utilization); null: weights + KV cache")

    def __post_init__(self):
        if min(self.tp, self.pp, self.cp, self.ep, self.etp or 1) < 1:
            raise ValueError(f"tp, pp, cp, ep and etp must be >= 1, got tp={self.tp} pp={self.pp} cp={self.cp} "
                             f"ep={self.ep} etp={self.etp}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        self.stage_split().check_pp(self.pp)

    def stage_split(self, key: str = "") -> StageSplit:
        """The layer split of this role's pipeline stages (`megalign.parallel.StageSplit`; `key` names it in errors)."""
        layers = tuple(self.stage_layers) if self.stage_layers is not None else None
        return StageSplit(layers, self.first_stage_layers, self.last_stage_layers, key)


@dataclasses.dataclass
class PlanConfig:
    """A run to plan: the model, the GPUs, the algorithm's batch and the roles."""

    model: str = option(doc="a preset (llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b, qwen2.5-7b, qwen2.5-72b, "
                            "qwen3-0.6b, qwen3-1.7b, qwen3-8b, qwen3-32b, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b), "
                            "an HF config.json or a checkpoint folder")
    algorithm: Literal["grpo", "ppo", "sft", "dpo", "kto", "rm"] = option(doc="which phases run: grpo / ppo (rollout, scoring, update), sft / rm (update), dpo / kto (reference scoring, update)")
    gpus: int = option(doc="GPUs of the run (the 'main' pool unless `pools` says otherwise)")
    gpu_memory_gib: float = option(80.0, doc="memory of one GPU, GiB")
    pools: dict[str, int] = option({}, doc="named GPU pools {name: GPUs} for roles on separate GPUs (OpenRLHF / NeMo-Aligner style); empty: {main: gpus}")
    prompt_length: int = option(512, doc="prompt tokens (padded); supervised: the prompt part of max_length")
    response_length: int = option(512, doc="response tokens (online: max_response_length; supervised: the rest of max_length)")
    group_size: int = option(1, doc="G: responses per prompt (online)")
    prompts_per_step: int = option(64, doc="online: prompts per step over all dp ranks; supervised: rows (pairs for dpo) per step over all dp ranks")
    mini_batches: int = option(1, doc="optimizer steps per rollout (online): a pipeline call covers rows / mini_batches")
    micro_batch_size: int = option(1, doc="sequences (pairs for dpo / kto) per forward in the update, per dp rank")
    score_micro_batch_size: Optional[int] = option(None, doc="sequences per no-grad scoring forward, per dp rank; null: micro_batch_size")
    rollout_micro_batch_size: Optional[int] = option(
        None, doc="sequences generated at once per generating dp rank; null: the rank's whole share of the step (megalign)")
    recompute_old_logprobs: bool = option(False, doc="online: the actor re-scores the rollout (old_logprobs=recompute)")
    attention: Literal["flash", "sdpa"] = option("flash", doc="flash: flash-attn (no s x s tensor); sdpa: PyTorch SDPA over a padded batch (saves the [b, 1, s, s] mask)")
    loss_path: Literal["eager", "fused"] = option("eager", doc="eager: LM head then vocab-parallel log-prob ([tokens, V/tp] logits and their gradient; megalign's trainers before issue 12); fused: fused_linear_token_logprob (megalign's trainers now)")
    fused_chunk: int = option(1024, doc="fused loss path: tokens per logits chunk")
    actor: Optional[RolePlan] = option(RolePlan(), doc="the trained policy (sft/dpo/kto: the trained model; rm: the trained reward model)")
    critic: Optional[RolePlan] = option(None, doc="PPO's value model (trained, scalar head)")
    reference: Optional[RolePlan] = option(None, doc="the frozen reference policy")
    reward: Optional[RolePlan] = option(None, doc="a frozen reward model (scalar head); null: verifiers only")
    generator: Optional[RolePlan] = option(None, doc="a separate inference engine for the rollout (vLLM, TRT-LLM); null: the actor generates (megalign's hybrid engine)")

    def __post_init__(self):
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        for name in ("prompt_length", "response_length", "group_size", "prompts_per_step", "mini_batches",
                     "micro_batch_size", "fused_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.actor is None:
            raise ValueError("actor is required (the trained model)")
        pools = self.pool_sizes()
        for name in ROLES:
            role = getattr(self, name)
            if role is None:
                continue
            if role.pool not in pools:
                raise ValueError(f"{name}.pool {role.pool!r} is not a pool; pools: {sorted(pools)}")
            if pools[role.pool] % (role.tp * role.pp * role.cp):
                raise ValueError(f"{name}: tp * pp * cp = {role.tp * role.pp * role.cp} must divide the "
                                 f"{pools[role.pool]} GPUs of pool {role.pool!r}")
            if pools[role.pool] % ((role.etp or role.tp) * role.ep * role.pp):
                raise ValueError(f"{name}: etp * ep * pp = {(role.etp or role.tp) * role.ep * role.pp} must divide the "
                                 f"{pools[role.pool]} GPUs of pool {role.pool!r} (Megatron's expert grid; etp null: tp)")
            if role.lora is not None and name not in TRAINED:
                raise ValueError(f"{name}.lora: only trained roles ({', '.join(TRAINED)}) have adapters")
        if self.algorithm == "ppo" and self.critic is None:
            raise ValueError("algorithm ppo needs a critic role")

    def pool_sizes(self) -> dict[str, int]:
        return dict(self.pools) if self.pools else {"main": self.gpus}

    def roles(self) -> dict[str, RolePlan]:
        return {name: getattr(self, name) for name in ROLES if getattr(self, name) is not None}


def steps(plan: PlanConfig) -> list[Step]:
    """The steps of one training step of `plan.algorithm`, in order, by phase."""
    out: list[Step] = []
    if plan.algorithm in ("grpo", "ppo"):
        out.append(Step("rollout", "generator" if plan.generator else "actor", "rollout"))
        for name in ("reference", "reward", "critic"):
            if getattr(plan, name) is not None:
                out.append(Step("scoring", name, "score"))
        if plan.recompute_old_logprobs:
            out.append(Step("scoring", "actor", "score"))
        out.append(Step("update", "actor", "update"))
        if plan.algorithm == "ppo":
            out.append(Step("update", "critic", "update"))
    else:
        if plan.algorithm in ("dpo", "kto") and plan.reference is not None:
            out.append(Step("scoring", "reference", "score"))
        out.append(Step("update", "actor", "update"))
    return out


class Planner:
    """Bytes per rank of every role in every step of a `PlanConfig` (see `megalign.plan` for the model)."""

    def __init__(self, plan: PlanConfig, model: Optional[ModelConfig] = None):
        self.plan = plan
        self.model = model or load_model(plan.model)
        self.pools = plan.pool_sizes()
        self.roles = plan.roles()
        # with actor.lora the reference is the actor with its adapters off (megalign, TRL, verl): the actor's layout
        self.shared_reference = plan.actor.lora is not None and "reference" in self.roles
        if self.shared_reference:
            self.roles["reference"] = dataclasses.replace(plan.actor, lora=None, offload_optimizer=False)
        self.splits = {name: role.stage_split(name) for name, role in self.roles.items()}
        for name, role in self.roles.items():  # checks tp, pp, ep and the layer split against the shapes, naming them
            if self.model.num_experts % role.ep:
                raise ValueError(f"{name}.ep={role.ep} must divide the model's {self.model.num_experts} experts")
            if role.ep > 1 and not self.model.num_experts:
                raise ValueError(f"{name}.ep={role.ep}: {plan.model} is not a mixture-of-experts model")
            stage_params(self.role_model(name), role.tp, role.pp, 0, split=self.splits[name])
        self.rows = 2 if plan.algorithm in ("dpo", "kto") else 1  # chosen + rejected (dpo), labelled + mismatched (kto)
        self.problems: list[str] = []

    # ----- shapes

    @property
    def seq(self) -> int:
        return self.plan.prompt_length + self.plan.response_length

    def scored_positions(self) -> int:
        """Positions whose logits the loss needs: the response (online: `hidden[:, -R-1:-1]`) or the whole sequence."""
        return self.plan.response_length if self.plan.algorithm in ("grpo", "ppo") else self.seq

    def dp(self, name: str) -> int:
        return role_dp(self.plan, name)

    def expert_dp(self, name: str) -> int:
        """Ranks holding the same experts (Megatron's expert data-parallel group): GPUs / (etp * ep * pp)."""
        role = self.roles[name]
        return self.pools[role.pool] // ((role.etp or role.tp) * role.ep * role.pp)

    def rows_per_rank(self, name: str) -> int:
        """Sequences one dp rank of `name` handles per step (whole groups of G for online runs)."""
        per_step = self.plan.prompts_per_step * (self.plan.group_size if self.plan.algorithm in ("grpo", "ppo") else 1)
        return ceil_div(per_step * self.rows, self.dp(name))

    def has_lm_head(self, name: str) -> bool:
        return not (name in ("critic", "reward") or (name == "actor" and self.plan.algorithm == "rm"))

    def role_model(self, name: str) -> ModelConfig:
        """The model as role `name` holds it: a separate engine (vLLM) at tp above the kv heads replicates them, one
        per rank, where megalign's layers refuse that tp."""
        tp, kv = self.roles[name].tp, self.model.num_key_value_heads
        if name == "generator" and tp > kv and tp % kv == 0:
            return dataclasses.replace(self.model, num_key_value_heads=tp)
        return self.model

    def stage(self, name: str, stage: int, lora: bool = False):
        """`StageParams` of `name` on `stage` (its adapters' with `lora`)."""
        role = self.roles[name]
        return stage_params(self.role_model(name), role.tp, role.pp, stage, head=self.has_lm_head(name), split=self.splits[name],
                            ep=role.ep, etp=role.etp, lora=role.lora if lora else None)

    def moe_layers(self, name: str, stage: int) -> int:
        """MoE layers on `stage` of `name` (the rest of its layers are dense)."""
        role, split = self.roles[name], self.splits[name]
        sizes = split.sizes(self.model.num_hidden_layers, role.pp)
        start = sum(sizes[:stage])
        return sum(self.model.is_moe_layer(i) for i in range(start, start + sizes[stage]))

    # ----- bytes

    def recipe(self, name: str) -> tuple[int, int, int]:
        role = self.roles[name]
        if role.recipe == "megalign":
            return MEGALIGN
        if role.recipe == "megatron":
            return MEGATRON_BF16_GRADS if role.main_grads == "bf16" else MEGATRON["bf16" if role.dtype == "bf16" else "fp32"]
        return ZERO

    def states(self, name: str, stage: int) -> tuple[float, float, float, int]:
        """(weights, grads, optimizer) bytes and the parameter count of `name` on `stage`. Non-expert states shard
        over dp x cp, routed experts' over the expert data-parallel group (Megatron). A LoRA role's frozen base is
        in the compute dtype (megalign: its fp32 master weights) and only the adapters (and a critic's head) carry
        gradients and optimizer state; the adapter-off reference holds nothing of its own."""
        role = self.roles[name]
        sp = self.stage(name, stage)
        n, experts = sp.total, sp.experts
        rope = 4 * self.model.max_position_embeddings * self.model.head_dim  # fp32 cos / sin tables on every stage
        shards = (self.dp(name) * role.cp, self.expert_dp(name))

        def sharded(per_param: tuple[float, float, float], zero: int) -> tuple[float, float, float]:
            dense = state_bytes_per_param(per_param, shards[0], zero)
            expert = state_bytes_per_param(per_param, shards[1], zero)
            return tuple((n - experts) * d + experts * e for d, e in zip(dense, expert))

        if name == "reference" and self.shared_reference:
            return 0.0, 0.0, 0.0, n
        trained = name in TRAINED
        if not trained or role.lora is not None:
            frozen = 4 if (trained and role.recipe == "megalign") or role.dtype == "fp32" else 2
            weights = sharded((frozen, 0, 0), 3 if role.zero_stage == 3 else 0)[0]
            if not trained:
                return weights + rope, 0.0, 0.0, n
            adapters = self.stage(name, stage, lora=True).total
            adapters += self.model.hidden_size if (not self.has_lm_head(name) and stage == role.pp - 1) else 0
            w, g, o = (adapters * x for x in state_bytes_per_param(self.recipe(name), shards[0], role.zero_stage))
            return weights + w + rope, g, (0.0 if role.cpu_optimizer else o), n
        w, g, o = sharded(self.recipe(name), role.zero_stage)
        return w + rope, g, (0.0 if role.cpu_optimizer else o), n

    def compute_bytes(self, name: str) -> int:
        return 2 if self.roles[name].dtype == "bf16" else 4

    def layer_activation_bytes(self, name: str, b: int, recompute: Optional[str] = None, moe: bool = False) -> float:
        """Bytes one layer saves for backward for a micro-batch of b sequences (recompute: the role's unless given);
        `moe`: an MoE layer (the k routed experts' SwiGLU intermediates per token, and `moe_dispatch_bytes`). A LoRA
        role of megalign's recipe saves less (`megalign_lora_delta_bytes`; its MoE layers and the other recipes are
        counted as full fine-tuning, an upper bound)."""
        role, cfg = self.roles[name], self.role_model(name)
        recompute = recompute or role.activation_checkpointing
        s = ceil_div(self.seq, role.cp)
        ffn = self.mlp_width(moe)
        extra = 0.0
        if moe and recompute != "full":
            split = 1 if role.recipe == "megalign" or not role.sequence_parallel else role.tp
            extra = moe_dispatch_bytes(s * b, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                       self.compute_bytes(name), split)
        if role.recipe == "megalign":
            if role.lora is not None and recompute != "full" and not moe:  # frozen weights save less (formulas)
                extra = megalign_lora_delta_bytes(s * b, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                                                  cfg.num_key_value_heads * cfg.head_dim, ffn, set(role.lora.modules()),
                                                  role.lora.rank, role.tp, self.compute_bytes(name), cfg.qk_norm)
            return extra + megalign_layer_bytes(s, b, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                ffn, role.tp, self.compute_bytes(name), self.plan.attention,
                                                "full" if recompute == "full" else "none", cfg.head_dim, cfg.qk_norm)
        return extra + korthikanti_layer_bytes(s, b, cfg.hidden_size, cfg.num_attention_heads, role.tp,
                                               role.sequence_parallel, recompute, ffn, gated=True,
                                               kv_heads=cfg.num_key_value_heads, dropout=False,
                                               flash=self.plan.attention == "flash")

    def mlp_width(self, moe: bool) -> int:
        """SwiGLU width a token goes through: f, or in an MoE layer k x moe_intermediate_size plus the shared expert."""
        cfg = self.model
        if not moe:
            return cfg.intermediate_size
        return cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size

    def stage_activation_bytes(self, name: str, stage: int, b: int, in_flight: int) -> float:
        """The layers of `stage` for `in_flight` micro-batches of b (dense and MoE layers each with their own count)."""
        layers = self.stage(name, stage).layers
        moe = self.moe_layers(name, stage)
        per = (layers - moe) * self.layer_activation_bytes(name, b) + moe * self.layer_activation_bytes(name, b, moe=True)
        acts = per * in_flight
        if self.roles[name].activation_checkpointing == "full":  # the layer being recomputed holds its whole activations
            acts += self.layer_activation_bytes(name, b, recompute="none", moe=moe > 0)
        return acts + self.all_to_all_bytes(name, b * ceil_div(self.seq, self.roles[name].cp), moe > 0)

    def all_to_all_bytes(self, name: str, tokens: int, moe: bool) -> float:
        """ep > 1: one MoE layer's dispatch send and receive buffers, [tokens x k, h] each (balanced routing)."""
        role, cfg = self.roles[name], self.role_model(name)
        if not moe or role.ep == 1:
            return 0.0
        split = role.tp if (role.sequence_parallel and role.recipe != "megalign") else 1
        return 2 * tokens * cfg.num_experts_per_tok * cfg.hidden_size * self.compute_bytes(name) / split

    def logits_bytes(self, name: str, b: int, grad: bool) -> float:
        """The loss path's [b, positions, V / tp] logits (and their gradient in training), or the fused path's chunk."""
        if not self.has_lm_head(name):
            return 0.0
        role, cfg = self.roles[name], self.role_model(name)
        rows = padded_vocab(cfg, role.tp) // role.tp
        e = self.compute_bytes(name)
        copies = 2 if grad else 1
        positions = ceil_div(self.scored_positions(), role.cp)
        if self.plan.loss_path == "fused":
            accumulator = rows * cfg.hidden_size * 4 if (grad and e == 2) else 0
            return min(self.plan.fused_chunk, b * positions) * rows * e * copies + accumulator
        return b * positions * rows * e * copies

    def forward_live_bytes(self, name: str, b: int, s: int) -> float:
        """No-grad forward: the residual stream, a norm output and the live SwiGLU intermediates of one layer (an
        MoE model: of its k routed experts and shared expert, plus the dispatched rows and their buffers)."""
        role, cfg = self.roles[name], self.role_model(name)
        e = self.compute_bytes(name)
        residual = 4 if (role.recipe == "megalign" and name in TRAINED) else e
        moe = cfg.num_experts > 0
        tokens = b * ceil_div(s, role.cp)
        live = tokens * (2 * residual * cfg.hidden_size + 3 * e * self.mlp_width(moe) / role.tp)
        if moe:
            live += moe_dispatch_bytes(tokens, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, e, 1)
        return live + self.all_to_all_bytes(name, tokens, moe)

    def kv_cache_bytes(self, name: str, b: int, stage: int) -> float:
        """2 x layers x b x (P + R) x kv_heads / tp x head_dim in the weights' dtype (megalign: the actor's fp32)."""
        role, cfg = self.roles[name], self.role_model(name)
        layers = self.stage(name, stage).layers
        weight_bytes = 4 if (name in TRAINED and role.recipe == "megalign") else (2 if role.dtype == "bf16" else 4)
        return 2 * layers * b * self.seq * (cfg.num_key_value_heads // role.tp) * cfg.head_dim * weight_bytes

    def cast_bytes(self, name: str, stage: int, n: int, in_flight: int, grad: bool) -> float:
        """megalign's bf16 autocast copies of a trained role's weights: the cached copy of every weight (full
        fine-tuning); with LoRA autocast caches only the adapters' (they require grad), and the base's copies are
        made per use (the embedding's lookup makes none): saved for backward by each micro-batch in flight in
        training (under full recomputation the layers' only by the layer being recomputed), one layer's and the
        head's at a time without."""
        role = self.roles[name]
        if not (name in TRAINED and role.recipe == "megalign" and role.dtype == "bf16"):
            return 0.0
        if role.lora is None:
            return CAST_COPY_BYTES * n
        sp, adapters = self.stage(name, stage), self.stage(name, stage, lora=True).total
        head = sp.embedding if (self.model.tie_word_embeddings and role.pp == 1) else sp.head
        layer = layer_params(self.model, role.tp, None, role.ep, role.etp)
        if not grad:
            return CAST_COPY_BYTES * (layer + head + adapters)
        if role.activation_checkpointing == "full":
            return CAST_COPY_BYTES * (head * in_flight + layer + adapters)
        return CAST_COPY_BYTES * ((sp.layer_params + head) * in_flight + adapters)

    def role_bytes(self, name: str, step: Step, stage: int) -> Bytes:
        """What `name` holds on one rank of `stage` during `step`."""
        role, cfg, plan = self.roles[name], self.role_model(name), self.plan
        weights, grads, optimizer, n = self.states(name, stage)
        active = step.role == name
        persistent_grads = name in TRAINED and role.recipe != "megalign"  # Megatron / DeepSpeed keep grad buffers
        out = Bytes()
        if not active:
            # the adapter-off reference scores with the actor's own weights, which stay in for that step
            lent = name == "actor" and step.role == "reference" and self.shared_reference
            out.weights = 0.0 if (role.offload_weights and not lent) else weights
            out.optimizer = 0.0 if role.offload_optimizer else optimizer
            out.grads = grads if persistent_grads else 0.0
            if name == "generator" and role.memory_fraction and not role.offload_weights:
                out.weights = max(out.weights, role.memory_fraction * plan.gpu_memory_gib * 2 ** 30)
            return out
        out.weights = weights
        out.optimizer = optimizer if (step.kind == "update" or not role.offload_optimizer) else 0.0
        out.grads = grads if (step.kind == "update" or persistent_grads) else 0.0
        gathered = 2 * 2 * layer_params(cfg, role.tp, None, role.ep, role.etp) if role.zero_stage == 3 else 0.0
        first, last = stage == 0, stage == role.pp - 1
        if step.kind == "update":
            b = plan.micro_batch_size * self.rows
            n_micro = max(1, ceil_div(self.rows_per_rank(name), plan.mini_batches * b))
            in_flight = pipeline_in_flight(role.pp, stage, n_micro)
            acts = self.stage_activation_bytes(name, stage, b, in_flight)
            tokens = b * ceil_div(self.seq, role.cp)
            acts += in_flight * tokens * (4 * cfg.head_dim + (8 if first else 0))  # RoPE cos / sin; token ids
            if last:  # the final norm (megalign: fp32 input and normalised value) and the head's input
                own = role.recipe == "megalign"
                acts += tokens * (8 * cfg.hidden_size + 4 if own else 2 * cfg.hidden_size)
                positions = ceil_div(self.scored_positions(), role.cp)
                acts += b * positions * cfg.hidden_size * (self.compute_bytes(name) if own else 2)
                out.logits = self.logits_bytes(name, b, grad=True)
            out.activations = acts + self.cast_bytes(name, stage, n, in_flight, grad=True) + gathered
        elif step.kind == "score":
            b = plan.score_micro_batch_size or plan.micro_batch_size
            b *= self.rows
            casts = self.cast_bytes("actor" if self.shared_reference and name == "reference" else name, stage, n, 1, False)
            out.activations = self.forward_live_bytes(name, b, self.seq) + casts + gathered
            out.logits = self.logits_bytes(name, b, grad=False) if last else 0.0
        else:
            b = min(self.rows_per_rank(name), plan.rollout_micro_batch_size or self.rows_per_rank(name))
            out.kv_cache = self.kv_cache_bytes(name, b, stage)
            vocab = padded_vocab(cfg, role.tp)
            out.activations = (self.forward_live_bytes(name, b, plan.prompt_length) + gathered
                               + self.cast_bytes(name, stage, n, 1, grad=False))
            out.logits = 3 * b * vocab * 4 if last else 0.0  # gathered [B, V] fp32 logits, scaled, probabilities
            if role.memory_fraction:  # the engine sizes its KV cache to what its reservation leaves (vLLM)
                reserved = role.memory_fraction * plan.gpu_memory_gib * 2 ** 30
                out.kv_cache = max(0.0, reserved - out.weights - out.activations - out.logits)
                if not out.kv_cache:
                    self.problems.append(
                        f"{name}: memory_fraction {role.memory_fraction:g} reserves {gib(reserved):.1f} GiB, which its "
                        f"weights ({gib(out.weights):.1f} GiB) and activations leave no KV cache in (vLLM refuses to start)")
        return out

    def worst_stage(self, name: str, step: Step) -> tuple[int, Bytes]:
        """The pipeline stage of `name` that holds the most in `step`, and its bytes."""
        pp = self.roles[name].pp
        candidates = [(s, self.role_bytes(name, step, s)) for s in range(pp)]
        return max(candidates, key=lambda c: c[1].total)

    def estimate(self) -> "Estimate":
        """Every step's bytes per pool (each role at its worst stage) and the peak of each phase."""
        rows = []
        for step in steps(self.plan):
            for pool in self.pools:
                names = [n for n, r in self.roles.items() if r.pool == pool]
                if not names:
                    continue
                per_role = {}
                for n in names:
                    stage, b = self.worst_stage(n, step)
                    per_role[n] = (stage, b)
                rows.append(StepBytes(step, pool, per_role))
        # the layout shown is the one planned: the adapter-off reference's is the actor's
        plan = dataclasses.replace(self.plan, reference=self.roles["reference"]) if self.shared_reference else self.plan
        return Estimate(plan, self.model, rows, plan_notes(self), list(dict.fromkeys(self.problems)))


def plan_memory(plan: PlanConfig, model: Optional[ModelConfig] = None) -> Estimate:
    """The estimate of `plan` (the model from `plan.model` unless given)."""
    return Planner(plan, model).estimate()
