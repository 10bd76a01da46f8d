"""The plan: a run's roles and batch, and the bytes each rank holds in each phase (module doc of `megalign.plan`)."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from megalign.config import option
from megalign.models.config import ModelConfig
from megalign.parallel.layout import StageSplit
from megalign.plan.formulas import (CAST_COPY_BYTES, MEGALIGN, MEGATRON, MEGATRON_BF16_GRADS, ZERO, ceil_div, gib,
                                    korthikanti_layer_bytes, megalign_layer_bytes, pipeline_in_flight,
                                    state_bytes_per_param)
from megalign.plan.model import layer_params, load_model, padded_vocab, stage_layers, stage_params

ROLES = ("actor", "critic", "reference", "reward", "generator")
TRAINED = ("actor", "critic")
PARTS = ("weights", "grads", "optimizer", "activations", "kv_cache", "logits")
ALGORITHMS = ("grpo", "ppo", "sft", "dpo", "kto", "rm")


@dataclasses.dataclass
class RolePlan:
    """How one role is placed and stored; every role of a run has its own."""

    tp: int = option(1, doc="tensor-parallel size")
    pp: int = option(1, doc="pipeline-parallel size (1F1B for training)")
    first_stage_layers: Optional[int] = option(None, doc="pp > 1: decoder layers of the first stage (Megatron's --decoder-first-pipeline-num-layers); the middle stages split the rest evenly")
    last_stage_layers: Optional[int] = option(None, doc="pp > 1: decoder layers of the last stage (Megatron's --decoder-last-pipeline-num-layers)")
    stage_layers: Optional[list[int]] = option(None, doc="pp > 1: decoder layers of every stage (pp entries summing to the model's layers); instead of first / last")
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
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")
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
                            "qwen3-0.6b, qwen3-1.7b, qwen3-8b, qwen3-32b), an HF config.json or a checkpoint folder")
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
            if pools[role.pool] % (role.tp * role.pp):
                raise ValueError(f"{name}: tp * pp = {role.tp * role.pp} must divide the {pools[role.pool]} GPUs of pool {role.pool!r}")
        if self.algorithm == "ppo" and self.critic is None:
            raise ValueError("algorithm ppo needs a critic role")

    def pool_sizes(self) -> dict[str, int]:
        return dict(self.pools) if self.pools else {"main": self.gpus}

    def roles(self) -> dict[str, RolePlan]:
        return {name: getattr(self, name) for name in ROLES if getattr(self, name) is not None}


@dataclasses.dataclass
class Bytes:
    """One role's bytes on one rank in one step, by part."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    logits: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, p) for p in PARTS)

    def as_dict(self) -> dict[str, float]:
        return {**{p: getattr(self, p) for p in PARTS}, "total": self.total}


@dataclasses.dataclass
class Step:
    """A moment of a phase: which role computes and how (update / score / rollout)."""

    phase: str
    role: str
    kind: Literal["update", "score", "rollout"]


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
        self.splits = {name: role.stage_split(name) for name, role in self.roles.items()}
        for name, role in self.roles.items():  # checks tp, pp and the layer split against the shapes, naming them
            stage_params(self.model, role.tp, role.pp, 0, split=self.splits[name])
        self.rows = 2 if plan.algorithm in ("dpo", "kto") else 1  # chosen + rejected (dpo), labelled + mismatched (kto)

    # ----- shapes

    @property
    def seq(self) -> int:
        return self.plan.prompt_length + self.plan.response_length

    def scored_positions(self) -> int:
        """Positions whose logits the loss needs: the response (online: `hidden[:, -R-1:-1]`) or the whole sequence."""
        return self.plan.response_length if self.plan.algorithm in ("grpo", "ppo") else self.seq

    def dp(self, name: str) -> int:
        return role_dp(self.plan, name)

    def rows_per_rank(self, name: str) -> int:
        """Sequences one dp rank of `name` handles per step (whole groups of G for online runs)."""
        per_step = self.plan.prompts_per_step * (self.plan.group_size if self.plan.algorithm in ("grpo", "ppo") else 1)
        return ceil_div(per_step * self.rows, self.dp(name))

    def has_lm_head(self, name: str) -> bool:
        return not (name in ("critic", "reward") or (name == "actor" and self.plan.algorithm == "rm"))

    # ----- bytes

    def states(self, name: str, stage: int) -> tuple[float, float, float, int]:
        """(weights, grads, optimizer) bytes and the parameter count of `name` on `stage`."""
        role = self.roles[name]
        n = stage_params(self.model, role.tp, role.pp, stage, head=self.has_lm_head(name), split=self.splits[name]).total
        rope = 4 * self.model.max_position_embeddings * self.model.head_dim  # fp32 cos / sin tables on every stage
        if name not in TRAINED:
            shards = self.dp(name) if role.zero_stage == 3 else 1  # ZeRO-3 inference shards frozen weights too
            return n * (2 if role.dtype == "bf16" else 4) / shards + rope, 0.0, 0.0, n
        if role.recipe == "megalign":
            recipe = MEGALIGN
        elif role.recipe == "megatron":
            recipe = MEGATRON_BF16_GRADS if role.main_grads == "bf16" else MEGATRON["bf16" if role.dtype == "bf16" else "fp32"]
        else:
            recipe = ZERO
        w, g, o = state_bytes_per_param(recipe, self.dp(name), role.zero_stage)
        return n * w + rope, n * g, (0.0 if role.cpu_optimizer else n * o), n

    def compute_bytes(self, name: str) -> int:
        return 2 if self.roles[name].dtype == "bf16" else 4

    def layer_activation_bytes(self, name: str, b: int, recompute: Optional[str] = None) -> float:
        """Bytes one layer saves for backward for a micro-batch of b sequences (recompute: the role's unless given)."""
        role, cfg = self.roles[name], self.model
        recompute = recompute or role.activation_checkpointing
        if role.recipe == "megalign":
            return megalign_layer_bytes(self.seq, b, cfg.hidden_size, cfg.num_attention_heads,
                                        cfg.num_key_value_heads, cfg.intermediate_size, role.tp,
                                        self.compute_bytes(name), self.plan.attention,
                                        "full" if recompute == "full" else "none", cfg.head_dim, cfg.qk_norm)
        return korthikanti_layer_bytes(self.seq, b, cfg.hidden_size, cfg.num_attention_heads, role.tp,
                                       role.sequence_parallel, recompute, cfg.intermediate_size,
                                       gated=True, kv_heads=cfg.num_key_value_heads, dropout=False,
                                       flash=self.plan.attention == "flash")

    def logits_bytes(self, name: str, b: int, grad: bool) -> float:
        """The loss path's [b, positions, V / tp] logits (and their gradient in training), or the fused path's chunk."""
        if not self.has_lm_head(name):
            return 0.0
        role, cfg = self.roles[name], self.model
        rows = padded_vocab(cfg, role.tp) // role.tp
        e = self.compute_bytes(name)
        copies = 2 if grad else 1
        if self.plan.loss_path == "fused":
            accumulator = rows * cfg.hidden_size * 4 if (grad and e == 2) else 0
            return min(self.plan.fused_chunk, b * self.scored_positions()) * rows * e * copies + accumulator
        return b * self.scored_positions() * rows * e * copies

    def forward_live_bytes(self, name: str, b: int, s: int) -> float:
        """No-grad forward: the residual stream, a norm output and the live SwiGLU intermediates of one layer."""
        role, cfg = self.roles[name], self.model
        e = self.compute_bytes(name)
        residual = 4 if (role.recipe == "megalign" and name in TRAINED) else e
        return b * s * (2 * residual * cfg.hidden_size + 3 * e * cfg.intermediate_size / role.tp)

    def kv_cache_bytes(self, name: str, b: int, stage: int) -> float:
        """2 x layers x b x (P + R) x kv_heads / tp x head_dim in the weights' dtype (megalign: the actor's fp32)."""
        role, cfg = self.roles[name], self.model
        layers = stage_params(cfg, role.tp, role.pp, stage, split=self.splits[name]).layers
        weight_bytes = 4 if (name in TRAINED and role.recipe == "megalign") else (2 if role.dtype == "bf16" else 4)
        return 2 * layers * b * self.seq * (cfg.num_key_value_heads // role.tp) * cfg.head_dim * weight_bytes

    def role_bytes(self, name: str, step: Step, stage: int) -> Bytes:
        """What `name` holds on one rank of `stage` during `step`."""
        role, cfg, plan = self.roles[name], self.model, self.plan
        weights, grads, optimizer, n = self.states(name, stage)
        active = step.role == name
        persistent_grads = name in TRAINED and role.recipe != "megalign"  # Megatron / DeepSpeed keep grad buffers
        out = Bytes()
        if not active:
            out.weights = 0.0 if role.offload_weights else weights
            out.optimizer = 0.0 if role.offload_optimizer else optimizer
            out.grads = grads if persistent_grads else 0.0
            if name == "generator" and role.memory_fraction and not role.offload_weights:
                out.weights = max(out.weights, role.memory_fraction * plan.gpu_memory_gib * 2 ** 30)
            return out
        out.weights = weights
        out.optimizer = optimizer if (step.kind == "update" or not role.offload_optimizer) else 0.0
        out.grads = grads if (step.kind == "update" or persistent_grads) else 0.0
        casts = CAST_COPY_BYTES * n if (name in TRAINED and role.recipe == "megalign" and role.dtype == "bf16") else 0.0
        gathered = 2 * 2 * layer_params(cfg, role.tp) if role.zero_stage == 3 else 0.0  # ZeRO-3: two layers gathered
        first, last = stage == 0, stage == role.pp - 1
        if step.kind == "update":
            b = plan.micro_batch_size * self.rows
            n_micro = max(1, ceil_div(self.rows_per_rank(name), plan.mini_batches * b))
            layers = stage_params(cfg, role.tp, role.pp, stage, split=self.splits[name]).layers
            per_layer = self.layer_activation_bytes(name, b)
            in_flight = pipeline_in_flight(role.pp, stage, n_micro)
            acts = per_layer * layers * in_flight
            if role.activation_checkpointing == "full":  # the layer being recomputed holds its whole activations
                acts += self.layer_activation_bytes(name, b, recompute="none")
            tokens = b * self.seq
            acts += in_flight * tokens * (4 * cfg.head_dim + (8 if first else 0))  # RoPE cos / sin; token ids
            if last:  # the final norm (megalign: fp32 input and normalised value) and the head's input
                own = role.recipe == "megalign"
                acts += tokens * (8 * cfg.hidden_size + 4 if own else 2 * cfg.hidden_size)
                acts += b * self.scored_positions() * cfg.hidden_size * (self.compute_bytes(name) if own else 2)
                out.logits = self.logits_bytes(name, b, grad=True)
            out.activations = acts + casts + gathered
        elif step.kind == "score":
            b = plan.score_micro_batch_size or plan.micro_batch_size
            b *= self.rows
            out.activations = self.forward_live_bytes(name, b, self.seq) + casts + gathered
            out.logits = self.logits_bytes(name, b, grad=False) if last else 0.0
        else:
            b = min(self.rows_per_rank(name), plan.rollout_micro_batch_size or self.rows_per_rank(name))
            out.kv_cache = self.kv_cache_bytes(name, b, stage)
            vocab = padded_vocab(cfg, role.tp)
            out.activations = self.forward_live_bytes(name, b, plan.prompt_length) + casts + gathered
            out.logits = 3 * b * vocab * 4 if last else 0.0  # gathered [B, V] fp32 logits, scaled, probabilities
            if role.memory_fraction:  # the engine sizes its KV cache to what its reservation leaves (vLLM)
                reserved = role.memory_fraction * plan.gpu_memory_gib * 2 ** 30
                out.kv_cache = max(0.0, reserved - out.weights - out.activations - out.logits)
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
        return Estimate(self.plan, self.model, rows)


@dataclasses.dataclass
class StepBytes:
    step: Step
    pool: str
    roles: dict[str, tuple[int, Bytes]]

    @property
    def total(self) -> float:
        return sum(b.total for _, b in self.roles.values())


@dataclasses.dataclass
class Estimate:
    """The planner's answer: per step and pool the bytes of each role; per phase the peak; whether it fits."""

    plan: PlanConfig
    model: ModelConfig
    rows: list[StepBytes]

    @property
    def capacity(self) -> float:
        return self.plan.gpu_memory_gib * 2 ** 30

    def phase_peaks(self) -> dict[str, StepBytes]:
        peaks: dict[str, StepBytes] = {}
        for row in self.rows:
            if row.step.phase not in peaks or row.total > peaks[row.step.phase].total:
                peaks[row.step.phase] = row
        return peaks

    def peak(self) -> StepBytes:
        return max(self.rows, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.peak().total <= self.capacity

    def as_dict(self) -> dict:
        def row_dict(row: StepBytes) -> dict:
            return {"phase": row.step.phase, "active_role": row.step.role, "kind": row.step.kind, "pool": row.pool,
                    "total_bytes": row.total,
                    "roles": {n: {"stage": s, **b.as_dict()} for n, (s, b) in row.roles.items()}}
        peak = self.peak()
        return {"model": self.plan.model, "algorithm": self.plan.algorithm, "gpu_memory_bytes": self.capacity,
                "pools": self.plan.pool_sizes(),
                "layout": {n: {"tp": r.tp, "pp": r.pp, "dp": role_dp(self.plan, n),
                               "stage_layers": stage_layers(self.model.num_hidden_layers, r.pp, r.stage_split(n))}
                           for n, r in self.plan.roles().items()},
                "steps": [row_dict(r) for r in self.rows],
                "phases": {p: row_dict(r) for p, r in self.phase_peaks().items()},
                "peak": {"phase": peak.step.phase, "active_role": peak.step.role, "pool": peak.pool,
                         "total_bytes": peak.total},
                "fits": self.fits}

    def _stages(self, name: str, role: RolePlan) -> str:
        """" layers [2, 4, ..., 2]" for a role with uneven pipeline stages, else ""."""
        split = role.stage_split(name)
        return f" layers {stage_layers(self.model.num_hidden_layers, role.pp, split)}" if split.uneven else ""

    def table(self) -> str:
        """A short terminal table: per phase, the peak step's roles and parts in GiB, then the verdict."""
        lines = [f"{self.plan.model} ({self.plan.algorithm}), {self.plan.gpus} GPUs x {self.plan.gpu_memory_gib:g} GiB, "
                 f"pools {self.plan.pool_sizes()}",
                 "layout: " + ", ".join(f"{n} tp{r.tp} pp{r.pp}{self._stages(n, r)} dp{role_dp(self.plan, n)} {r.dtype}"
                                         for n, r in self.plan.roles().items()),
                 f"{'phase':<8} {'pool':<8} {'role':<10} {'stage':>5} " + " ".join(f"{p:>11}" for p in PARTS) + f" {'total':>9}"]
        for phase, row in self.phase_peaks().items():
            for name, (stage, b) in row.roles.items():
                mark = "*" if name == row.step.role else " "
                lines.append(f"{phase:<8} {row.pool:<8} {name + mark:<10} {stage:>5} "
                             + " ".join(f"{gib(getattr(b, p)):>11.2f}" for p in PARTS) + f" {gib(b.total):>9.2f}")
            lines.append(f"{phase:<8} {row.pool:<8} {'= rank':<10} {'':>5} " + " " * (12 * len(PARTS)) + f"{gib(row.total):>9.2f}")
        peak = self.peak()
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"peak: {peak.step.phase} ({peak.step.role} {peak.step.kind}) on pool {peak.pool}: "
                     f"{gib(peak.total):.2f} GiB of {self.plan.gpu_memory_gib:g} GiB -> {verdict}  (* = the computing role, GiB)")
        return "\n".join(lines)


def role_dp(plan: PlanConfig, name: str) -> int:
    """Data-parallel size of role `name`: its pool's GPUs / (tp * pp)."""
    role = getattr(plan, name)
    return plan.pool_sizes()[role.pool] // (role.tp * role.pp)


def plan_memory(plan: PlanConfig, model: Optional[ModelConfig] = None) -> Estimate:
    """The estimate of `plan` (the model from `plan.model` unless given)."""
    return Planner(plan, model).estimate()
