"""LoRA in the online trainers: `actor.lora` (GRPO, PPO, online DPO) and PPO's `critic.lora`.

The adapters are `megalign.models.lora`'s, used as the supervised trainers use them (`megalign.trainers.supervised`):

- `apply_lora` runs on the role's model (its pipeline stage at pp > 1: adapters seeded by global layer name) right
  after loading and before its optimizer is built, so the base is frozen and AdamW (`build_optimizer`, over the
  parameters with requires_grad) holds adapter state only. The critic's value head trains whole (a new head, the
  supervised trainers' rule for heads), its trunk through adapters (`apply_role_lora`).
- Checkpoints: `ModelState` writes a LoRA model's trainable tensors only (the adapters, and a critic's head); every
  start rebuilds the base from the role's path, which the checkpoint's config names (a changed path is a resume
  error) and `BaseFingerprint` fingerprints (`megalign.checkpoint.data_files`: a base changed under the same path
  refuses the resume, naming its files, or with `resume_changes=allow` warns). Everything else (optimizer state,
  RNG, sampler) is checkpointed as in a full run, so a resume is exact.
- The reference of the KL term (or of online DPO's loss) is the actor's model with its adapters off
  (`megalign.roles.adapter_reference.AdapterOffReference`): no second copy of the weights. It scores in the
  actor's layout and precision, and its weights are the actor's, placed by `actor.offload_weights` (the trainer's
  `place` keeps the actor's weights in for a phase that needs the reference's). So `reference.path` must be null or
  `actor.path`, and the reference's own layout, dtype and offload switch do not apply: set to anything but their
  defaults (or the actor's values) they are refused, naming them (`check_adapter_off_reference`), before any
  weights load.
- Rollout: the engine runs the LoRA forward as is on the training modules (each adapted linear adds
  `scale * x A^T B^T` in every prefill and decode step), with no copy of the base and no merge. Merging before the
  rollout and unmerging after was measured against it (the tiny GRPO policy of the tests after 3 LoRA steps,
  rank 4 on all linears, max |B| 0.29; largest |rollout log-prob - the trainer's recomputation| over a step's
  response tokens): fp32 4.8e-7 unmerged vs 9.5e-7 merged; bf16 compute 8.1e-3 unmerged vs 3.0e-2 merged (the merged
  engine rounds `W + s B A` where the trainer computes `x W^T + s x A^T B^T`; its samples differ too). And
  `W + s B A - s B A` is not `W` in floating point: one merge / unmerge round trip moved 14 of the 21 base tensors
  (by up to 3e-8), so the frozen base would drift every step. The test of `old_logprobs: rollout`
  (tests/trainers/test_lora_online.py) holds the unmerged engine to the full model's tolerance.
- Export: merged into HF weights (`export_hf` folds `scale * B A` into a copy of the base's tensors), or with
  `actor.lora_export: peft` a PEFT adapter folder over `actor.path` (`export_peft_adapter`, pp = 1). The critic
  exports merged.
- Adapter dropout must be 0 (`online_config.check_online_lora`): a mask drawn per forward would make the rollout,
  the recomputed scores and the update see different policies.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

import torch

from megalign.checkpoint.data_files import data_file_changes, fingerprint_path
from megalign.config import ConfigError
from megalign.models.lora import LoRAConfig, apply_lora
from megalign.roles import ModelRoleConfig

logger = logging.getLogger(__name__)


def apply_role_lora(model: torch.nn.Module, lora: Optional[LoRAConfig], seed: int) -> torch.nn.Module:
    """`model` with adapters on its linears named in `lora` (nothing when None) and its base frozen; a model with a
    value head (the PPO critic) keeps the head trainable (module doc). Before the role's optimizer is built."""
    if lora is not None:
        apply_lora(model, lora, seed=seed)
        head = getattr(model, "head", None)
        if head is not None:
            head.requires_grad_(True)
    return model


def check_adapter_off_reference(reference: ModelRoleConfig, actor: ModelRoleConfig) -> None:
    """Before any weights load: with `actor.lora` the reference is the actor with adapters off (module doc), so
    `reference.path` must be null or `actor.path`, and its layout, dtype and offload switch must be left at their
    defaults or the actor's values. ValueError naming the keys otherwise."""
    if reference.path not in (None, actor.path):
        raise ValueError(f"reference.path={reference.path!r}: with actor.lora the reference is actor.path's base "
                         f"model (the actor with its adapters off, no second copy of the weights); leave "
                         f"reference.path null or equal to actor.path")
    default = ModelRoleConfig()
    keys = ("tp", "pp", "first_stage_layers", "last_stage_layers", "stage_layers", "dtype")
    ignored = [f"reference.{k}={getattr(reference, k)!r}" for k in keys
               if getattr(reference, k) not in (getattr(default, k), getattr(actor, k))]
    if reference.offload_weights:
        ignored.append("reference.offload_weights=True")
    if ignored:
        raise ValueError(f"{', '.join(ignored)}: with actor.lora the reference is the actor's own model with its "
                         f"adapters off, scoring in the actor's layout and dtype with the actor's weights (offloaded by "
                         f"actor.offload_weights); these reference settings do not apply: leave them unset")


class BaseFingerprint:
    """The fingerprints of the frozen base's files (`fingerprint_path` of the role's folder) in a LoRA checkpoint,
    compared on resume (module doc): the adapters were trained on that base and mean nothing on another.

    `key`: the config key naming the folder (`actor.path`); `files`: `fingerprint_path(path)` taken at start-up
    (read by one rank: `Trainer.on_rank0`); `allow`: the run's `resume_changes` is `allow` (warn, not raise).
    Saved as a JSON string, the same on every rank.
    """

    def __init__(self, key: str, path: str, files: Optional[dict[str, Any]], allow: bool):
        self.key, self.path, self.files, self.allow = key, path, files, allow

    def state_dict(self) -> dict[str, Any]:
        return {"path": self.path, "files": json.dumps(self.files, sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {self.key: {"path": state["path"], "files": json.loads(state["files"])}}
        changes = data_file_changes(saved, {self.key: {"path": self.path, "files": self.files}})
        if not changes:
            return
        listed = "; ".join(f"'{file}': {why}" for _, file, why in changes)
        message = (f"{self.key}={self.path!r}: the base model the checkpoint's LoRA adapters were trained on has "
                   f"changed ({listed})")
        if not self.allow:
            raise ConfigError(f"resume: {message}. Adapters mean nothing on another base: restore it, set "
                              f"resume_changes=allow to load them anyway, or resume=none to start afresh", key=self.key)
        logger.warning("resume_changes=allow: %s; loading the adapters anyway", message)


def base_fingerprint(trainer, key: str, path: str) -> BaseFingerprint:
    """`BaseFingerprint` of folder `path` (config `key`) of `trainer`'s run: the files read on rank 0 alone."""
    files = trainer.on_rank0(lambda: fingerprint_path(path))
    return BaseFingerprint(key, path, files, trainer.cfg.resume_changes == "allow")
