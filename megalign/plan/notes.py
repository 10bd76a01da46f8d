"""The estimate's notes: what a plan assumes that megalign's trainers do not run, and what LoRA saves.

- cp > 1 on any role, an expert tp other than tp, or ep > 1 on a frozen role (reference, reward): megalign's
  trainers have no context parallelism, slice every expert by tp, and split experts over ep ranks on their trained
  roles only (`actor.ep`, `critic.ep`, `model.ep`), so the plan describes a peer's run (Megatron, NeMo-RL, verl), not
  a megalign one (`megalign.plan.planner`'s doc).
- A LoRA role: its adapter parameters, and its optimizer + gradient bytes per rank against the same role's full
  fine-tuning (the issue's "<= 10% of full fine-tuning's" is read from this line).
- The adapter-off reference: the weight bytes per rank a separate frozen reference in the actor's layout (its tp,
  pp, dtype, ZeRO-3 sharding) would hold (on the device while it scores where the actor's weights are offloaded),
  which the plan does not count.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megalign.plan.formulas import gib

if TYPE_CHECKING:
    from megalign.plan.planner import Planner


TRAINED_ROLES = ("actor", "critic")
"""The planner's roles whose megalign config has `ep` (`megalign.roles.TrainedRoleConfig`; a supervised run's model is
the actor)."""


def lora_saving(planner: "Planner", name: str, stage: int = 0) -> tuple[int, float, float]:
    """(adapter parameters, optimizer + gradient bytes with LoRA, the same bytes under full fine-tuning) of `name`
    on `stage` per rank."""
    role = planner.roles[name]
    adapters = planner.stage(name, stage, lora=True).total
    _, grads, optimizer, _ = planner.states(name, stage)
    planner.roles[name] = dataclasses.replace(role, lora=None)
    try:
        _, full_grads, full_optimizer, _ = planner.states(name, stage)
    finally:
        planner.roles[name] = role
    return adapters, grads + optimizer, full_grads + full_optimizer


def plan_notes(planner: "Planner") -> list[str]:
    """The notes of `planner`'s estimate (module doc), in role order."""
    notes = []
    beyond = [f"{n}.cp={r.cp}" for n, r in planner.roles.items() if r.cp > 1]
    beyond += [f"{n}.etp={r.etp}" for n, r in planner.roles.items() if r.ep > 1 and r.etp not in (None, r.tp)]
    beyond += [f"{n}.ep={r.ep}" for n, r in planner.roles.items() if r.ep > 1 and n not in TRAINED_ROLES]
    if beyond:
        notes.append(f"{', '.join(beyond)}: megalign's trainers run cp=1, slice each expert by tp (etp = tp) and split "
                     f"experts over ep ranks on trained roles only (actor.ep, critic.ep); this plan judges a peer's "
                     f"layout, not a megalign run")
    for name, role in planner.roles.items():
        if role.lora is None:
            continue
        adapters, lora_bytes, full_bytes = lora_saving(planner, name)
        notes.append(f"{name}: LoRA rank {role.lora.rank} on {','.join(role.lora.modules())}: {adapters:,} adapter "
                     f"parameters per rank (stage 0); optimizer + gradients {gib(lora_bytes):.3f} GiB vs "
                     f"{gib(full_bytes):.2f} GiB full fine-tuning ({lora_bytes / full_bytes:.2%})")
    if planner.shared_reference:
        actor = planner.roles["actor"]
        planner.shared_reference = False  # the states of a reference of its own, in the actor's layout
        try:
            copy = planner.states("reference", 0)[0]
        finally:
            planner.shared_reference = True
        notes.append(f"reference: the actor with its adapters off, no copy of the weights (a separate {actor.dtype} "
                     f"reference in the actor's layout would hold {gib(copy):.2f} GiB per rank on stage 0"
                     f"{' while it scores' if actor.offload_weights else ''})")
    return notes
