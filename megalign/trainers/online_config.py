"""The online family's configuration, declared once: the roles, prompts and sampling every online run has
(`OnlineConfig`), and the update schedule every online algorithm's `algo` section inherits
(`UpdateSchedule`: micro-batch, mini-batches, epochs, loss aggregation), which `OnlineTrainer.train_role`
reads. GRPO, PPO and online DPO subclass both (`megalign.trainers.grpo`, `ppo`, `online_dpo`). Also the
start-up pieces that read only the configuration: the prompt datasets it names and the pipeline micro-batch
check of a role.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Literal, Optional

from megalign.algos.aggregation import LOSS_AGGREGATIONS
from megalign.algos.offpolicy import OffPolicyConfig, check_off_policy
from megalign.config import option
from megalign.data import PromptDataset, Tokenizer, load_prompts, make_splits, write_jsonl
from megalign.models import batch_invariant
from megalign.models.lora import LoRAConfig
from megalign.parallel import ParallelLayout
from megalign.roles import ModelRoleConfig, RewardConfig, TrainedRoleConfig
from megalign.rollout import EngineConfig, MultiTurnConfig
from megalign.trainers.base import DataConfig, RunConfig
from megalign.trainers.disaggregated import PlacementConfig
from megalign.trainers.evaluation import EvalConfig
from megalign.trainers.optim import OptimConfig


def check_microbatches(key: str, cfg: ModelRoleConfig) -> None:
    """ValueError naming `key`.microbatches unless it is 0: the online trainers' pipeline micro-batches are
    `algo.micro_batch_size` rows (module doc), so the key would be ignored."""
    if cfg.microbatches:
        raise ValueError(f"{key}.microbatches={cfg.microbatches}: the online trainers split each rank's responses "
                         f"into pipeline micro-batches of algo.micro_batch_size rows; leave {key}.microbatches at 0")


def check_online_lora(key: str, lora: Optional[LoRAConfig]) -> None:
    """ValueError naming `key`.lora.dropout unless it is 0: an online role's forwards (rollout, old log-probs or
    values, the update) must see the same adapter, which a dropout mask drawn per forward breaks (the ratio of an
    on-policy update would not start at 1)."""
    if lora is not None and lora.dropout:
        raise ValueError(f"{key}.lora.dropout={lora.dropout}: the online trainers need lora.dropout=0 (the rollout, "
                         f"the recomputed scores and the update must see the same adapters)")


@dataclasses.dataclass
class ActorConfig(TrainedRoleConfig):
    """The policy: an HF checkpoint (e.g. the SFT export `run_dir/hf`), its layout, dtype and offload."""

    path: Optional[str] = option("runs/sft_arith/hf", doc="HF checkpoint folder of the initial policy")
    offload_optimizer: bool = option(False, doc="move the optimizer state to host memory outside the update phase")
    head_chunk_tokens: int = option(1024, doc="tokens per chunk of the fused LM head in the actor's log-probs: its only "
                                              "[tokens, vocab / tp] temporary is one [head_chunk_tokens, vocab / tp] "
                                              "logits chunk in the compute dtype (fp32 at vocab 151936: 594 MiB at "
                                              "1024, 148 MiB at 256); smaller saves memory, with smaller matmuls")
    lora: Optional[LoRAConfig] = option(None, doc="LoRA adapters {rank, alpha, dropout (must be 0), target_modules}: the base "
                                                  "is frozen, the reference is the actor with adapters off "
                                                  "(`megalign.trainers.online_lora`); null: full fine-tuning")
    lora_export: Literal["merged", "peft"] = option(
        "merged", doc="with lora: export the adapters merged into HF weights, or as a PEFT adapter folder over actor.path")
    batch_invariant: bool = option(
        False, doc="the batch-invariant mode (`megalign.models.batch_invariant`) for the whole run: the rollout's "
                   "log-probs equal the recomputation and the training forward bit for bit (ratios exactly 1 with "
                   "old_logprobs: rollout), at a cost in speed (BENCHMARKS.md); CPU, tp = 1 (any pp, dp); "
                   "MEGALIGN_BATCH_INVARIANT, when set, overrides it")
    routing_replay: bool = option(
        False, doc="MoE actor: its old-log-prob recomputation and training forwards reuse the experts the rollout chose "
                   "(`megalign.trainers.online_moe`); false: moe/router_agreement is logged instead")
    moe_aux_loss_coef: Optional[float] = option(
        None, doc="MoE actor: weight of the load-balancing loss added to the actor loss (logged as "
                  "actor/moe_aux_loss); null: the checkpoint's router_aux_loss_coef when its config sets "
                  "output_router_logits, else 0")

    def __post_init__(self):
        super().__post_init__()
        if not self.path:
            raise ValueError("actor.path (an HF checkpoint folder) is required")
        if self.head_chunk_tokens < 1:
            raise ValueError(f"actor.head_chunk_tokens must be >= 1, got {self.head_chunk_tokens}")
        check_online_lora("actor", self.lora)
        if self.moe_aux_loss_coef is not None and not self.moe_aux_loss_coef >= 0:
            raise ValueError(f"actor.moe_aux_loss_coef must be >= 0 (or null), got {self.moe_aux_loss_coef}")
        if self.lora_export == "peft" and (self.lora is None or self.pp > 1):
            raise ValueError(f"actor.lora_export: peft needs actor.lora and actor.pp=1 (got "
                             f"{'no lora' if self.lora is None else f'pp={self.pp}'}); export merged otherwise")


@dataclasses.dataclass
class OnlineReferenceConfig(ModelRoleConfig):
    """The frozen reference of an online run."""

    routing_replay: bool = option(False, doc="MoE reference with the actor's MoE layers: its forwards reuse the experts "
                                             "the actor's rollout chose (`megalign.trainers.online_moe`)")


@dataclasses.dataclass
class PromptDataConfig(DataConfig):
    """Prompts with verifiable answers: the embedded arithmetic task, or JSONL / Parquet files."""

    path: Optional[str] = option(None, doc="prompt file (.jsonl / .parquet; rows: prompt or messages, answer); null: the arithmetic task's train split")
    max_prompt_length: int = option(64, doc="prompts with more tokens are dropped and counted")

    def __post_init__(self):
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {self.max_prompt_length}")


@dataclasses.dataclass
class EnvConfig:
    """Multi-turn episodes against an environment (`megalign.envs`, `megalign.trainers.episodes`): each prompt row
    starts G episodes of `name`; an episode (prompt, policy turns, observations) is one row of
    rollout.max_response_length + 1 tokens at most."""

    name: str = option(doc="the environment class, 'package.module:Class' or 'path/to/file.py:Class' (e.g. "
                           "megalign.envs.tool_env:ToolEnv)")
    kwargs: dict[str, Any] = option({}, doc="keyword arguments of the class, checked at start-up (one is built)")
    max_turns: int = option(8, doc="policy turns per episode at most; an episode still going is truncated (counted)")
    max_turn_tokens: Optional[int] = option(None, doc="tokens per policy turn at most; null: rollout.max_response_length")
    max_time_s: float = option(0.0, doc="wall-clock seconds per episode, 0 = no limit (a limit makes episodes depend on "
                                        "the machine's speed, so a resumed run may differ)")
    stop_strings: list[str] = option([], doc="texts that end a policy turn (e.g. '</tool_call>')")
    score_final_turn: bool = option(True, doc="also score the last policy turn's text with reward.terms / models / "
                                              "judges (added to the environment's reward); false: the environment's "
                                              "reward alone")
    reward_placement: Literal["last_token", "per_turn"] = option(
        "last_token", doc="where PPO's GAE finds an episode's reward: last_token: the total (turn rewards summed, the "
                          "final-turn terms added) at the episode's last policy token; per_turn: each turn's "
                          "environment reward at that turn's last policy token, the final-turn terms at the "
                          "episode's last (`RolloutBatch.turn_rewards`). GRPO / RLOO / online DPO train on the "
                          "total either way (`megalign.trainers.episodes`)")

    def __post_init__(self):
        if not isinstance(self.name, str) or ":" not in self.name:
            raise ValueError(f"rollout.env.name must look like 'module:Class' or 'file.py:Class', got {self.name!r}")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"rollout.env.kwargs must be a mapping, got {type(self.kwargs).__name__}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"rollout.env.max_turn_tokens must be >= 1 (or null), got {self.max_turn_tokens}")
        try:  # MultiTurnConfig's own checks of max_turns, max_time_s, stop_strings (its messages name the key)
            self.multiturn(2)
        except ValueError as exc:
            raise ValueError(f"rollout.env.{exc}") from None

    def multiturn(self, max_response_length: int) -> MultiTurnConfig:
        """The rollout's `MultiTurnConfig`: an episode holds max_response_length + 1 tokens at most (one batch row)."""
        return MultiTurnConfig(max_turns=self.max_turns, max_total_tokens=max_response_length + 1,
                               max_time_s=self.max_time_s, stop_strings=list(self.stop_strings))


@dataclasses.dataclass
class RolloutConfig:
    """How responses are sampled."""

    group_size: int = option(8, doc="G: responses sampled per prompt")
    prompts_per_step: int = option(32, doc="prompts per step over all dp ranks (a multiple of dp)")
    temperature: float = option(1.0, doc="sampling temperature (> 0); log-probs use the same temperature")
    top_p: float = option(1.0, doc="nucleus sampling threshold (1 = off)")
    max_response_length: int = option(24, doc="generated tokens per response at most (with rollout.env: tokens of "
                                                   "an episode after its first token: prompt, turns, observations)")
    old_logprobs: Literal["rollout", "recompute"] = option(
        "rollout", doc="old log-probs of the ratio: those recorded while sampling, or a fresh forward after it")
    engine: EngineConfig = option(EngineConfig(), doc="how the rollout engine batches (max_batch, sync_every, static, "
                                                      "cuda_graphs); it never changes the samples")
    pack: bool = option(True, doc="scoring and training forwards (actor, reference, critic) run on the rows' real tokens "
                                  "packed (cu_seqlens) instead of padded rows; the same log-probs and values (at pp > 1: one pack a pipeline "
                                  "micro-batch)")
    pack_tokens: Optional[int] = option(None, doc="tokens per packed forward at most (null: one padded row, longest "
                                                  "prompt + max_response_length; larger pays off with flash-attn)")
    pack_max_fill: float = option(0.5, doc="pack a forward's rows only when their real tokens fill at most this fraction "
                                           "of the padded rows (1.0: always): packing runs one trunk forward per pack, "
                                           "which on nearly full rows costs more than it saves")
    env: Optional[EnvConfig] = option(None, doc="multi-turn episodes against an environment {name, kwargs, max_turns, "
                                                "max_turn_tokens, max_time_s, stop_strings, score_final_turn, "
                                                "reward_placement}; null: one response per sample")

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages compare responses within a group), got {self.group_size}")
        if self.prompts_per_step < 1 or self.max_response_length < 1:
            raise ValueError("prompts_per_step and max_response_length must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.pack_tokens is not None and self.pack_tokens < 1:
            raise ValueError(f"pack_tokens must be >= 1 (or null), got {self.pack_tokens}")
        if not 0 <= self.pack_max_fill <= 1:
            raise ValueError(f"pack_max_fill must be in [0, 1], got {self.pack_max_fill}")


@dataclasses.dataclass
class MissingEOSPenalty:
    """TRL's `missing_eos_penalty` (PPOConfig, RLOOConfig, OnlineDPOConfig): a fixed amount subtracted from the score of
    every response cut at `rollout.max_response_length` before it ended with EOS. A learned reward model never saw
    such a cut response in its pairs (their replies end with EOS), so its score there is an extrapolation, and a
    policy that stops finishing can climb it (measured: BENCHMARKS.md, "Embedded SFT -> RM -> PPO")."""

    missing_eos_penalty: Optional[float] = option(
        None, doc="subtracted from the score of responses cut at max_response_length without EOS (TRL's); null: off")

    def check_missing_eos_penalty(self) -> None:
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(f"missing_eos_penalty must be >= 0 (it is subtracted), got {self.missing_eos_penalty}")


@dataclasses.dataclass
class UpdateSchedule:
    """How one step's samples become optimizer updates: `ppo_epochs` passes, each of `mini_batches` updates, each
    accumulated over micro-batches of `micro_batch_size` rows per rank, the loss aggregated by `loss_agg` over the
    mini-batch's global count (`megalign.algos.aggregation`). Every online algorithm's `algo` section is one."""

    loss_agg: str = option("token-mean", doc=f"loss aggregation: {', '.join(LOSS_AGGREGATIONS)}")
    mini_batches: int = option(1, doc="optimizer updates per epoch over the step's samples (each trained role)")
    ppo_epochs: int = option(1, doc="passes over the step's samples")
    micro_batch_size: int = option(64, doc="samples per forward on each rank (gradient accumulation)")

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {list(LOSS_AGGREGATIONS)}, got {self.loss_agg!r}")
        for name in ("mini_batches", "ppo_epochs", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def updates(self) -> int:
        """Optimizer updates per step of each trained role."""
        return self.ppo_epochs * self.mini_batches


@dataclasses.dataclass
class OnlineConfig(RunConfig):
    """What every online run has besides its algorithm: roles, prompts, sampling, optimizer, evaluation."""

    actor: ActorConfig = option(ActorConfig(), doc="the policy")
    reference: OnlineReferenceConfig = option(OnlineReferenceConfig(), doc="the frozen reference (built only when the "
                                                                          "algorithm needs it)")
    reward: RewardConfig = option(RewardConfig(), doc="the reward")
    data: PromptDataConfig = option(PromptDataConfig(), doc="prompts")
    rollout: RolloutConfig = option(RolloutConfig(), doc="sampling")
    optim: OptimConfig = option(OptimConfig(lr=1e-4, schedule="constant", warmup_steps=5), doc="optimizer and LR schedule (per step)")
    eval: EvalConfig = option(EvalConfig(), doc="held-out greedy evaluation before training, every N steps and at the end")
    algo: UpdateSchedule = option(UpdateSchedule(), doc="the objective (each algorithm's section extends the update schedule)")
    placement: PlacementConfig = option(PlacementConfig(), doc="colocated roles, or rollout ranks apart from the "
                                                                 "training ranks with bounded staleness")

    def __post_init__(self):
        super().__post_init__()
        if isinstance(getattr(self.algo, "off_policy", None), OffPolicyConfig):  # GRPO, PPO (online DPO has none)
            check_off_policy(self.algo.off_policy, self.algo.policy_loss, self.rollout.old_logprobs)
        check_moe_keys(self)
        if self.reward.empty() and (self.rollout.env is None or self.rollout.env.score_final_turn):
            raise ValueError("reward: the reward needs at least one term, reward model or judge (only multi-turn "
                             "episodes with rollout.env.score_final_turn=false take their whole reward from the "
                             "environment)")


def moe_keys_asked(cfg: OnlineConfig) -> list[str]:
    """The MoE settings the run turns on, as `key=value` for error messages (routing replay, a non-zero aux loss)."""
    coef = cfg.actor.moe_aux_loss_coef
    return [key for key, on in (("actor.routing_replay=true", cfg.actor.routing_replay),
                                ("reference.routing_replay=true", cfg.reference.routing_replay),
                                (f"actor.moe_aux_loss_coef={coef}", bool(coef))) if on]


def check_moe_keys(cfg: OnlineConfig) -> None:
    """Routing replay and the MoE aux loss (`megalign.trainers.online_moe`) need actor.pp = 1 and one turn: the
    pipelined rollout and multi-turn episodes record no routing. ValueError naming the keys otherwise."""
    asked = moe_keys_asked(cfg)
    if asked and cfg.actor.pp > 1:
        raise ValueError(f"{', '.join(asked)} needs actor.pp=1 (the pipelined rollout records no routing), got "
                         f"actor.pp={cfg.actor.pp}")
    if asked and cfg.rollout.env is not None:
        raise ValueError(f"{', '.join(asked)}: multi-turn episodes (rollout.env) record no routing yet")



def batch_invariant_switch(cfg: OnlineConfig, device_type: str, needs_reference: bool) -> bool:
    """Whether the run uses the batch-invariant mode: `MEGALIGN_BATCH_INVARIANT` when set (either way), else
    `actor.batch_invariant`. ValueError naming the setting where the mode cannot hold: a device other than the CPU
    (it fixes the order of the CPU's matmuls only; cuBLAS picks its kernels by shape) or a tensor-parallel actor or
    reference (their vocabulary-sharded head reduces the log-softmax over shards, which the mode does not fix)."""
    env = batch_invariant.env_override()
    on = cfg.actor.batch_invariant if env is None else env
    if not on:
        return False
    asked = "actor.batch_invariant=true" if env is None else f"{batch_invariant.ENV}={os.environ[batch_invariant.ENV]}"
    if device_type != "cpu":
        raise ValueError(f"{asked}: the batch-invariant mode runs on the CPU only (it fixes the order of the CPU's "
                         f"matmuls); device={device_type}")
    tps = {"actor.tp": cfg.actor.tp}
    if needs_reference and cfg.actor.lora is None:
        tps["reference.tp"] = cfg.reference.tp
    wide = [f"{key}={tp}" for key, tp in tps.items() if tp > 1]
    if wide:
        raise ValueError(f"{asked}: the batch-invariant mode needs tp=1 (the vocabulary-parallel head's log-softmax "
                         f"is not order-fixed); got {', '.join(wide)}")
    logging.getLogger(__name__).info("%s: the batch-invariant mode for the whole run (megalign.models.batch_invariant)",
                                     asked)
    return True


def check_actor(cfg: OnlineConfig, device_type: str, needs_reference: bool) -> bool:
    """The actor's start-up checks that read only the configuration (`check_microbatches`, `batch_invariant_switch`);
    returns whether the run uses the batch-invariant mode."""
    check_microbatches("actor", cfg.actor)
    # every MoE forward is an all-to-all over the ep group: its ranks must run the same forwards
    if cfg.actor.ep > 1 and cfg.rollout.pack:
        raise ValueError(f"actor.ep={cfg.actor.ep} needs rollout.pack=false: packed forwards number as the ranks' "
                         f"token counts fill the packs, so the ranks of an ep group would run different numbers of "
                         f"expert all-to-alls")
    if cfg.actor.ep > 1 and getattr(cfg.algo, "dynamic_sampling", False):
        raise ValueError(f"actor.ep={cfg.actor.ep} needs algo.dynamic_sampling=false: the ranks would keep different "
                         f"numbers of groups, so their sampling rounds and update forwards (an expert all-to-all "
                         f"each) would not match")
    return batch_invariant_switch(cfg, device_type, needs_reference)


def prompt_datasets(cfg: PromptDataConfig, tokenizer: Tokenizer, run_dir: str) -> tuple[PromptDataset, Optional[PromptDataset]]:
    """(training prompts, held-out prompts or None); the arithmetic splits are written to run_dir/data first."""
    load = dict(tokenizer=tokenizer, max_prompt_length=cfg.max_prompt_length, skip_invalid=cfg.skip_invalid,
                template_prompts=cfg.template_prompts)
    path, eval_path = cfg.path, cfg.eval_path
    if path is None:
        train, held_out = make_splits(cfg.arith)
        path = os.path.join(run_dir, "data", "arith_train.jsonl")
        write_jsonl(train, path)  # atomic: ranks racing to write the same file are safe
        if eval_path is None:
            eval_path = os.path.join(run_dir, "data", "arith_held_out.jsonl")
            write_jsonl(held_out, eval_path)
    return load_prompts(path, **load), (load_prompts(eval_path, **load) if eval_path is not None else None)


def check_pipeline_batch(cfg: OnlineConfig, actor_dp: int, key: str, layout: ParallelLayout, trained: bool,
                         per_prompt: Optional[int] = None, unit: str = "responses") -> None:
    """Start-up check of role `key` at pp > 1 beside an actor of `actor_dp` replicas, naming the settings: each rank's responses (a fixed number when
    every step keeps all its groups; `per_prompt` units of `unit` a prompt in place of the group's responses,
    e.g. online DPO's one pair) split into pipeline micro-batches of `algo.micro_batch_size` units, at least
    pp of them per scoring forward and, for a `trained` role, per mini-batch."""
    algo = cfg.algo
    per_prompt = cfg.rollout.group_size if per_prompt is None else per_prompt
    rows = cfg.rollout.prompts_per_step * per_prompt // actor_dp
    mini = algo.mini_batches if trained else 1
    if layout.pp == 1 or (rows % mini == 0 and (rows // mini) % algo.micro_batch_size == 0
                          and rows // mini // algo.micro_batch_size >= layout.pp):
        return
    what = f"algo.mini_batches={mini} mini-batches of " if trained else ""
    times = f"rollout.group_size={cfg.rollout.group_size}" if unit == "responses" else f"{per_prompt}"
    raise ValueError(f"{key}.pp={layout.pp}: each rank's {rows} {unit} (rollout.prompts_per_step="
                     f"{cfg.rollout.prompts_per_step} x {times} / dp={actor_dp}) must split into "
                     f"{what}at least pp={layout.pp} micro-batches of algo.micro_batch_size={algo.micro_batch_size} "
                     f"{'rows' if unit == 'responses' else unit}")
