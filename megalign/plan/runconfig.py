"""A megalign run config (examples/*.yaml of the trainers) read as a `PlanConfig`: take what the trainer has.

Which trainer: the registry of algorithms decides (`megalign.algos.registry.load`: the file's
`algorithm` key or the override `algorithm=NAME`; a file without one is the algorithm whose config
alone loads it), and the file is loaded with that algorithm's own config class, so its checks and
error messages (file, line, key) apply. The planner's phase model of each algorithm (`PLANNED_AS`):
online DPO is planned as GRPO (rollout, reference and reward scoring, an actor update; it updates
on 2 of the G samples of a prompt, so the update's activations are over-estimated), the PRM as SFT
(the reward tokens are read on the LM head of a trained causal LM).

What maps: role tp / pp (and its uneven stages: first_stage_layers / last_stage_layers / stage_layers) / dtype /
offload switches, a trained role's `lora` (then the reference is the actor with adapters off, no copy) and `ep`
(expert parallelism, etp = tp as megalign slices experts; never cp, which megalign's trainers do not have), the
reference when the registry says the run
builds it (`Algorithm.needs_reference`: the config attribute the trainer reads, e.g. the KL coefficient
of GRPO, REINFORCE++ and PPO), the critic of PPO, the reward model when `reward.model` or
`reward.models` is set (the first one only), prompts and responses (online:
data.max_prompt_length and rollout.max_response_length; supervised: data.max_length, all of it
scored), G, prompts per step, mini-batches, the rollout engine's slot cache (rollout.engine.max_batch, 0: every
sample of the rank), the micro-batch (online: algo.micro_batch_size;
supervised: batch_size / dp in one forward), old-log-prob recomputation, the trained roles'
`activation_checkpointing` (full recomputation). megalign's recipe throughout: fp32 master weights,
ZeRO-1, the eager loss path.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from megalign.algos.registry import load as load_algorithm
from megalign.config import ConfigError
from megalign.models.config import ModelConfig
from megalign.plan.model import load_model
from megalign.plan.planner import PlanConfig, RolePlan

PLANNED_AS = {"sft": "sft", "dpo": "dpo", "kto": "kto", "rm": "rm", "prm": "sft", "grpo": "grpo", "ppo": "ppo",
              "online_dpo": "grpo"}
"""`PlanConfig.algorithm` (the planner's phases) of each registered algorithm (module doc)."""


def _role(cfg, offload_optimizer: bool = False) -> RolePlan:
    from megalign.roles.base import TrainedRoleConfig  # as the trainers' configs, imported when a run config is read
    trained = isinstance(cfg, TrainedRoleConfig)
    recompute = "full" if trained and cfg.activation_checkpointing else "none"
    return RolePlan(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep if trained else 1, dtype=cfg.dtype,
                    offload_weights=cfg.offload_weights,
                    offload_optimizer=offload_optimizer, activation_checkpointing=recompute,
                    lora=getattr(cfg, "lora", None),
                    first_stage_layers=cfg.first_stage_layers, last_stage_layers=cfg.last_stage_layers,
                    stage_layers=cfg.stage_layers)


def _model(path: Optional[str], key: str, model: Optional[str]) -> str:
    if model is not None:
        return model
    if path is None or not os.path.exists(path):
        raise ConfigError(f"{key}={path!r} is not an existing checkpoint folder; pass the architecture with "
                          f"--model (a preset or a config.json)", key=key)
    return path


def plan_from_run_config(path: str, gpus: int, model: Optional[str] = None, overrides: Sequence[str] = (),
                         **plan_fields) -> tuple[PlanConfig, ModelConfig]:
    """(PlanConfig, model) of run config `path` on `gpus` ranks; `model` replaces the checkpoint's architecture.

    `plan_fields` set PlanConfig fields the trainers have no key for (gpu_memory_gib, attention, ...).
    """
    algo, cfg = load_algorithm(path, overrides)
    fields = dict(algorithm=PLANNED_AS[algo.name])
    if algo.family == "online":
        actor = cfg.actor
        fields.update(prompt_length=cfg.data.max_prompt_length, response_length=cfg.rollout.max_response_length,
                      group_size=cfg.rollout.group_size, prompts_per_step=cfg.rollout.prompts_per_step,
                      mini_batches=cfg.algo.mini_batches, micro_batch_size=cfg.algo.micro_batch_size,
                      recompute_old_logprobs=cfg.rollout.old_logprobs == "recompute",
                      rollout_micro_batch_size=cfg.rollout.engine.max_batch or None,
                      actor=_role(actor, actor.offload_optimizer),
                      # the planner has one reward role: the first reward model (several are not summed yet)
                      reward=_role(cfg.reward.reward_models()[0][1]) if cfg.reward.reward_models() else None)
        if algo.critic:
            fields["critic"] = _role(cfg.critic, cfg.critic.offload_optimizer)
        arch = _model(actor.path, "actor.path", model)
    else:
        length = cfg.data.max_length
        fields.update(prompt_length=length // 2, response_length=length - length // 2, prompts_per_step=cfg.batch_size,
                      micro_batch_size=max(1, cfg.batch_size // max(1, gpus // cfg.model.tp)), actor=_role(cfg.model))
        arch = None if cfg.model.path is None and model is None else _model(cfg.model.path, "model.path", model)
    if algo.needs_reference(cfg):
        fields["reference"] = _role(cfg.reference)
    if arch is None:  # a supervised model built from scratch: its architecture is in the config
        from megalign.data.tokenizer import build_tokenizer
        from megalign.trainers.supervised import scratch_config
        built = scratch_config(cfg.model, build_tokenizer(cfg.data.tokenizer, None))
        return PlanConfig(model="from-scratch", gpus=gpus, **fields, **plan_fields), built
    plan = PlanConfig(model=arch, gpus=gpus, **fields, **plan_fields)
    return plan, load_model(arch)
