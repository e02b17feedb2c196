"""Callbacks: the loop's extension point (OLMo-core's hooks, with typed return actions).

Hooks see frozen snapshots, never trainer internals. `pre_update` runs after the backward pass,
when loss and gradient norm are known and before the optimizer step, and returns an `Action`
that the loop carries out. Callback state goes into every checkpoint via `state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.core.actions import Action, Continue, Note

__all__ = ["Callback", "EvalState", "FitState", "StepState"]


@dataclass(frozen=True)
class StepState:
    step: int  # 1-based: this step's update makes it the step-th
    batch_index: int  # the global batch index this step trained on
    loss: float  # ce + z-loss term
    ce: float
    grad_norm: float  # before clipping
    clip_factor: float  # 1.0 when not clipped
    lr: float  # peak-group LR this step
    tokens: int  # tokens seen including this step
    nonfinite: bool  # loss or gradient not finite: the update is refused
    refused_by: str = ""  # the same-step tier refuses this update: why (trainer/core/same_step.py)
    applied: bool = False  # set for post_step: whether the update was applied
    action: str = "continue"
    reason: str = ""  # why, when the action is not "continue"
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalState:
    step: int
    val_loss: float


@dataclass(frozen=True)
class FitState:
    run_id: str
    run_dir: str
    step: int
    max_steps: int
    config: Mapping[str, Any]
    status: str = "running"  # at the end: completed | stopped | halted


class Callback:
    """Override what you need; lower `priority` runs later."""

    priority: int = 0

    def on_fit_start(self, state: FitState) -> None:
        """Before the first step (also after a resume)."""

    def pre_update(self, state: StepState) -> Action:
        """After backward, before the update: Continue, SkipUpdate or Rollback."""
        return Continue()

    def post_step(self, state: StepState) -> None:
        """After the step's outcome is settled."""

    def on_update_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """The update statistics of `step` (update norms, optimizer state), which exist only
        after its update and so arrive with the next step's host transfer (or at the end)."""

    def on_rollback(self, step: int, record: Mapping[str, Any]) -> None:
        """After the loop restored the checkpoint of `step` (the run continues from there);
        `record` is the intervention as stored in the run's summary."""

    def on_checkpoint(self, step: int, path: str, pinned: bool) -> None:
        """A checkpoint of `step` was handed to the writer (written, or being written)."""

    def on_checkpoint_change(self, step: int, path: str, status: str, pinned: bool) -> None:
        """A checkpoint landed on disk, checksummed (`status` "ok"), or was deleted by
        retention or a rollback ("deleted")."""

    def on_config_change(self, step: int, changes: Mapping[str, list[Any]]) -> None:
        """A resume at `step` changed settings a resume may change: {key: [then, now]}."""

    def take_notes(self) -> list[Note]:
        """What this callback wants in the run's record since the last call (the loop hands
        each to every callback's `on_note`)."""
        return []

    def on_note(self, note: Note) -> None:
        """A note of some callback, for the record (the Recorder stores it)."""

    def on_eval(self, state: EvalState) -> None:
        """After each validation pass."""

    def on_fit_end(self, state: FitState) -> None:
        """After the last step, also on a clean early stop."""

    def summary(self) -> dict[str, Any]:
        """Keys this callback adds to the run's summary JSON."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
