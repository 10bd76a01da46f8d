"""A megalign run config (examples/*.yaml of the trainers) read as a `PlanConfig`: take what the trainer has.

Which trainer: `actor` at the top level is the online family (GRPO; with a `critic` section PPO,
read with `megalign.trainers.ppo.PPOConfig` where that trainer exists); otherwise the supervised
family, told apart by `algo`: `loss` -> DPO, `margin` -> reward model, `beta` alone with a
`reference` -> KTO, no `algo` -> SFT. The file is then loaded with that trainer's own config class,
so its checks and error messages (file, line, key) apply.

What maps: role tp / pp / dtype / offload switches, the reference only
when the trainer builds one (GRPO: algo.beta > 0; PPO: algo.kl_coef > 0 or a kl_target; DPO and
KTO: always), the reward model when `reward.model` or `reward.models` is set (the first one only),
prompts and responses (online: data.max_prompt_length and rollout.max_response_length; supervised:
data.max_length, all of it scored), G, prompts per step, mini-batches, the micro-batch (GRPO:
algo.micro_batch_size; supervised: batch_size / dp in one forward), old-log-prob recomputation, the
trained roles' `activation_checkpointing` (full recomputation). megalign's recipe throughout: fp32
master weights, ZeRO-1, the eager loss path.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import yaml

from megalign.config import ConfigError, load_config
from megalign.models.config import ModelConfig
from megalign.plan.model import load_model
from megalign.plan.planner import PlanConfig, RolePlan


def detect_trainer(path: str) -> str:
    """'grpo', 'ppo', 'sft', 'dpo', 'rm' or 'kto' from the sections of the YAML file (module doc)."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r}: expected a mapping of config keys at the top level")
    if "actor" in data:
        return "ppo" if "critic" in data else "grpo"
    algo = data.get("algo") or {}
    if "loss" in algo:
        return "dpo"
    if "margin" in algo:
        return "rm"
    if "reference" in data and algo:
        return "kto"
    return "sft"


def _config_class(trainer: str):
    if trainer == "grpo":
        from megalign.trainers.grpo import GRPOConfig
        return GRPOConfig
    if trainer == "ppo":
        try:
            from megalign.trainers.ppo import PPOConfig
        except ImportError as e:
            raise ConfigError("a run config with a `critic` section needs the PPO trainer (megalign.trainers.ppo), "
                              "which this checkout lacks; describe the run in a planner file instead") from e
        return PPOConfig
    if trainer == "sft":
        from megalign.trainers.sft import SFTConfig
        return SFTConfig
    if trainer == "kto":
        from megalign.trainers.kto import KTOConfig
        return KTOConfig
    from megalign.trainers.preference import DPOConfig, RMConfig
    return DPOConfig if trainer == "dpo" else RMConfig


def _role(cfg, offload_optimizer: bool = False) -> RolePlan:
    from megalign.roles.base import TrainedRoleConfig  # as the trainers' configs, imported when a run config is read
    recompute = "full" if isinstance(cfg, TrainedRoleConfig) and cfg.activation_checkpointing else "none"
    return RolePlan(tp=cfg.tp, pp=cfg.pp, dtype=cfg.dtype, offload_weights=cfg.offload_weights,
                    offload_optimizer=offload_optimizer, activation_checkpointing=recompute)


def _model(path: Optional[str], key: str, model: Optional[str]) -> str:
    if model is not None:
        return model
    if path is None or not os.path.exists(path):
        raise ConfigError(f"{key}={path!r} is not an existing checkpoint folder; pass the architecture with "
                          f"--model (a preset or a config.json)", key=key)
    return path


def plan_from_run_config(path: str, gpus: int, model: Optional[str] = None, trainer: Optional[str] = None,
                         overrides: Sequence[str] = (), **plan_fields) -> tuple[PlanConfig, ModelConfig]:
    """(PlanConfig, model) of run config `path` on `gpus` ranks; `model` replaces the checkpoint's architecture.

    `plan_fields` set PlanConfig fields the trainers have no key for (gpu_memory_gib, attention, ...).
    """
    trainer = trainer or detect_trainer(path)
    cfg = load_config(_config_class(trainer), path, overrides)
    if trainer in ("grpo", "ppo"):
        actor = cfg.actor
        kl_on = cfg.algo.beta > 0 if trainer == "grpo" else (cfg.algo.kl_coef > 0 or cfg.algo.kl_target is not None)
        fields = dict(algorithm=trainer,
                      prompt_length=cfg.data.max_prompt_length, response_length=cfg.rollout.max_response_length,
                      group_size=cfg.rollout.group_size, prompts_per_step=cfg.rollout.prompts_per_step,
                      mini_batches=cfg.algo.mini_batches, micro_batch_size=cfg.algo.micro_batch_size,
                      recompute_old_logprobs=cfg.rollout.old_logprobs == "recompute",
                      actor=_role(actor, actor.offload_optimizer),
                      reference=_role(cfg.reference) if kl_on else None,
                      # the planner has one reward role: the first reward model (several are not summed yet)
                      reward=_role(cfg.reward.reward_models()[0][1]) if cfg.reward.reward_models() else None)
        if trainer == "ppo":
            fields["critic"] = _role(cfg.critic, cfg.critic.offload_optimizer)
        arch = _model(actor.path, "actor.path", model)
    else:
        length = cfg.data.max_length
        fields = dict(algorithm=trainer, prompt_length=length // 2, response_length=length - length // 2,
                      prompts_per_step=cfg.batch_size, micro_batch_size=max(1, cfg.batch_size // max(1, gpus // cfg.model.tp)),
                      actor=_role(cfg.model))
        if trainer in ("dpo", "kto"):
            fields["reference"] = _role(cfg.reference)
        if cfg.model.path is None and model is None:
            from megalign.data.tokenizer import build_tokenizer
            from megalign.trainers.supervised import scratch_config
            built = scratch_config(cfg.model, build_tokenizer(cfg.data.tokenizer, None))
            return PlanConfig(model="from-scratch", gpus=gpus, **fields, **plan_fields), built
        arch = _model(cfg.model.path, "model.path", model)
    plan = PlanConfig(model=arch, gpus=gpus, **fields, **plan_fields)
    return plan, load_model(arch)
