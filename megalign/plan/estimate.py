"""The planner's answer (`Estimate`): per step of a training step and per pool, the bytes each role holds on one
rank, the peak, the verdict, and the notes of what the plan assumes; a terminal table and JSON."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from megalign.models.config import ModelConfig
from megalign.plan.formulas import gib
from megalign.plan.model import stage_layers

if TYPE_CHECKING:
    from megalign.plan.planner import PlanConfig, RolePlan

PARTS = ("weights", "grads", "optimizer", "activations", "kv_cache", "logits")


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

    plan: "PlanConfig"
    model: ModelConfig
    rows: list[StepBytes]
    notes: list[str] = dataclasses.field(default_factory=list)
    """what the plan assumes that megalign's trainers do not run (cp, an expert tp other than tp, ep on a frozen role),
    and what LoRA saves"""
    problems: list[str] = dataclasses.field(default_factory=list)
    """reasons it does not run whatever the peak (a generator whose reservation cannot hold its weights)"""

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
        return self.peak().total <= self.capacity and not self.problems

    def as_dict(self) -> dict:
        def row_dict(row: StepBytes) -> dict:
            return {"phase": row.step.phase, "active_role": row.step.role, "kind": row.step.kind, "pool": row.pool,
                    "total_bytes": row.total,
                    "roles": {n: {"stage": s, **b.as_dict()} for n, (s, b) in row.roles.items()}}
        peak = self.peak()
        return {"model": self.plan.model, "algorithm": self.plan.algorithm, "gpu_memory_bytes": self.capacity,
                "pools": self.plan.pool_sizes(),
                "layout": {n: {"tp": r.tp, "pp": r.pp, "cp": r.cp, "ep": r.ep, "etp": r.etp, "dp": role_dp(self.plan, n),
                               "lora_rank": r.lora.rank if r.lora is not None else None,
                               "stage_layers": stage_layers(self.model.num_hidden_layers, r.pp, r.stage_split(n))}
                           for n, r in self.plan.roles().items()},
                "steps": [row_dict(r) for r in self.rows],
                "phases": {p: row_dict(r) for p, r in self.phase_peaks().items()},
                "peak": {"phase": peak.step.phase, "active_role": peak.step.role, "pool": peak.pool,
                         "total_bytes": peak.total},
                "notes": list(self.notes), "problems": list(self.problems), "fits": self.fits}

    def _stages(self, name: str, role: RolePlan) -> str:
        """" layers [2, 4, ..., 2]" for a role with uneven pipeline stages, else ""."""
        split = role.stage_split(name)
        return f" layers {stage_layers(self.model.num_hidden_layers, role.pp, split)}" if split.uneven else ""

    def table(self) -> str:
        """A short terminal table: per phase, the peak step's roles and parts in GiB, then the verdict."""
        lines = [f"{self.plan.model} ({self.plan.algorithm}), {self.plan.gpus} GPUs x {self.plan.gpu_memory_gib:g} GiB, "
                 f"pools {self.plan.pool_sizes()}",
                 "layout: " + ", ".join(f"{n} tp{r.tp} pp{r.pp}{self._stages(n, r)}{_extra(r)} dp{role_dp(self.plan, n)} {r.dtype}"
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
        lines += [f"note: {n}" for n in self.notes] + [f"problem: {p}" for p in self.problems]
        lines.append(f"peak: {peak.step.phase} ({peak.step.role} {peak.step.kind}) on pool {peak.pool}: "
                     f"{gib(peak.total):.2f} GiB of {self.plan.gpu_memory_gib:g} GiB -> {verdict}  (* = the computing role, GiB)")
        return "\n".join(lines)


def role_dp(plan: "PlanConfig", name: str) -> int:
    """Data-parallel size of role `name`: its pool's GPUs / (tp * pp * cp)."""
    role = getattr(plan, name)
    return plan.pool_sizes()[role.pool] // (role.tp * role.pp * role.cp)


def _extra(role: "RolePlan") -> str:
    """" cp2 ep16 etp1 lora32" for the options a role has beyond tp / pp, else ""."""
    out = f" cp{role.cp}" if role.cp > 1 else ""
    out += f" ep{role.ep}" if role.ep > 1 else ""
    out += f" etp{role.etp}" if role.etp is not None else ""
    return out + (f" lora{role.lora.rank}" if role.lora is not None else "")
