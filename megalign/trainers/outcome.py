"""What a run reports when it ends: `TrainResult`, the updates it made, and the failure of a run that did not train.

A run that does not train must not look like one that did (a reward model returning NaN, online DPO
where every group ties, exits 0 with the initial model exported otherwise). The loop classifies every
step: the policy's optimizer stepped (`progress["updates"]`), or an update was skipped and it did not
(`progress["skipped_steps"]`, with the reason counted under one of `SKIP_REASONS`), or neither (the
policy waits by design, PPO's critic warm-up). `check_updates` then fails a run whose policy never
moved, or that skipped more than `max_skipped_fraction` of the steps meant to move it, with the counts
by reason; otherwise the closing lines (`update_summary`, `accuracy_table`) state how many updates
happened.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

SKIP_REASONS = ("nan_skips", "empty_updates")
"""Why an update is skipped (`Trainer.skip_update`), each counted in `progress` and logged every step."""


@dataclasses.dataclass
class TrainResult:
    """What a run reports back."""

    step: int
    """Steps completed (cfg.steps at the end)."""
    metrics: list[dict[str, float]]
    """This invocation's logged metrics per step (a resumed run holds only the steps it ran)."""
    hf_path: Optional[str]
    """Folder of the HF export, or None."""
    accuracy_before: Optional[float] = None
    """Held-out accuracy before training (trainers with `eval_before`; kept across resumes), or None."""
    accuracy: Optional[float] = None
    """Held-out accuracy at the end, in [0, 1], or None when no evaluation ran."""
    updates: int = 0
    """Steps that updated the policy (kept across resumes)."""

    @property
    def accuracy_after(self) -> Optional[float]:
        return self.accuracy


class SkippedUpdatesError(RuntimeError):
    """The policy never moved, or more of its updates were skipped than `max_skipped_fraction` allows (module doc)."""


def update_summary(progress: dict[str, Any]) -> str:
    """How many steps updated the policy, and the skipped updates by reason: "5 of 6 steps (1 skipped: ...)"."""
    updates, skipped, steps = progress["updates"], progress["skipped_steps"], progress["step"]
    reasons = ", ".join(f"{reason} {progress[reason]}" for reason in SKIP_REASONS)
    waited = steps - updates - skipped
    return (f"{updates} of {steps} steps ({skipped} skipped: {reasons}"
            f"{f'; {waited} waiting by design' if waited > 0 else ''})")


def accuracy_table(before: Optional[float], after: float, steps: int, label: str, trained: str,
                   updates: str) -> str:
    """The before/after held-out accuracy table printed at the end of a run, headed by `label`, with the
    `updates` line (`update_summary`) under it."""
    rows = [("initial model", "-" if before is None else f"{before:6.1%}"), (f"{trained}, {steps} steps", f"{after:6.1%}")]
    if before is not None:
        rows.append(("change", f"{(after - before) * 100:+.1f} points"))
    rows.append(("policy updated in", updates))
    width = max(len(name) for name, _ in rows)
    lines = [label] + [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def check_updates(progress: dict[str, Any], ran: int, max_skipped_fraction: float, name: str) -> None:
    """SkippedUpdatesError when the policy never moved or skipped too many updates (module doc); `ran`: the steps
    this invocation ran, `name`: the trainer's. A finished run started again from a checkpoint written before the
    counters existed (`megalign.checkpoint.Counters`) ran and counted nothing, and has nothing to judge."""
    updates, skipped = progress["updates"], progress["skipped_steps"]
    never = not updates and (skipped or ran)
    if not never and skipped <= max_skipped_fraction * (updates + skipped):
        return
    why = ("the policy was never updated" if not updates else
           f"more than max_skipped_fraction={max_skipped_fraction} of the steps meant to update the "
           f"policy skipped their update")
    raise SkippedUpdatesError(
        f"{name}: {why}: updated in {update_summary(progress)}. The checkpoint of step "
        f"{progress['step']} is kept and nothing was exported; the warnings 'step N: ... skipping the "
        f"update' name the causes (a reward that is NaN, groups whose rewards all tie, ...)")
