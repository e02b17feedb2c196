"""Callbacks: the loop's extension point (OLMo-core's hooks, with typed return actions).

Hooks see frozen snapshots, never trainer internals. `on_step` runs once the step's values
reach the host, which is after its update has been enqueued (the GPU never waits for the host
between backward and the update, ARCHITECTURE.md), and returns an `Action` that the loop carries
out at the step's end: Continue, Rollback (to a checkpoint from before the step: the applied
update is discarded with the rest) or Halt. A refused update (non-finite values, the same-step
tier) was decided on the device already and arrives as `StepState.refused_by` / `nonfinite`.

A callback that must see a step *before* its update, to refuse it itself (`SkipUpdate`), or to
read the gradients, overrides `pre_update` instead: the loop then reads the step's values before
every update (the host path), which on a GPU drains the launch queue each step. Callback state
goes into every checkpoint via `state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spikewatch.trainer.core.actions import Action, Continue, Note

__all__ = ["Callback", "EvalState", "FitState", "StepState", "decides_before_update"]


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
    refused_by: str = ""  # the same-step tier refused this update: why (trainer/core/same_step.py)
    overflow: bool = False  # fp16: the GradScaler found inf/nan gradients and skipped the update
    # (its own business: it lowers its scale; not a spike, not a non-finite step)
    applied: bool = False  # set for post_step: whether the update was applied and kept
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
    resumed_from: str | None = None  # the checkpoint this process resumed from, if it did
    val_loss: float | None = None  # the run's last evaluation (after a resume: from before it)


class Callback:
    """Override what you need; lower `priority` runs later."""

    priority: int = 0

    def on_fit_start(self, state: FitState) -> None:
        """Before the first step (also after a resume)."""

    def on_step(self, state: StepState) -> Action:
        """The step's values, once they reach the host (its update is enqueued by then):
        Continue, Rollback or Halt, carried out at the step's end. The default asks
        `pre_update`, so that a callback written for it is heard either way."""
        return self.pre_update(state)

    def pre_update(self, state: StepState) -> Action:
        """Before the update: Continue, SkipUpdate, Rollback or Halt. Overriding it puts the
        run on the host path (the step's values are read before every update)."""
        return Continue()

    def post_step(self, state: StepState) -> None:
        """After the step's outcome is settled."""

    def on_update_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """The update statistics of `step` (update norms, optimizer state), which exist only
        after its update and so arrive with the next step's host transfer (or at the end)."""

    def on_rollback(self, step: int, record: Mapping[str, Any]) -> None:
        """After the loop restored the checkpoint of `step` (the run continues from there);
        `record` is the intervention as stored in the run's summary."""

    def on_restore(self, step: int, saved: Mapping[str, Any]) -> None:
        """A rollback is restoring the checkpoint of `step`; `saved` is this callback's
        `state_dict()` in it (empty when it holds none). Take back what belongs to the restored
        state (statistics of the steps it has seen), keep what the run has learned since (a
        rollback keeps the live state otherwise). `on_rollback` follows."""

    def on_stall(self, info: Mapping[str, Any]) -> None:
        """No step has ended for longer than the stall bound (core/watchdog.py). Called from
        the watchdog's thread, once per stall: `info` has the step, the idle seconds, the
        bound and every thread's stack."""

    def on_heartbeat(self, info: Mapping[str, Any]) -> None:
        """The process is alive (`info`: `period_s`, how often this comes): from the watchdog's
        thread, whether steps end or not, so that a run whose process is gone is told from a
        run that is stuck."""

    def on_stall_end(self, info: Mapping[str, Any]) -> None:
        """Steps end again after a stall (`info`: the step, `stalled_s`); the loop's thread."""

    def on_slowdown(self, info: Mapping[str, Any]) -> None:
        """The recent steps are slower than the run's own baseline by the slowdown factor
        (core/watchdog.py; `info`: the step, recent and baseline seconds, their ratio)."""

    def on_pace_back(self, info: Mapping[str, Any]) -> None:
        """A slowdown is over: the recent steps within 1.2x the baseline again."""

    def on_straggler(self, info: Mapping[str, Any]) -> None:
        """Under torchrun, on rank 0, from the watchdog's thread: one rank waits for its batches
        far longer than the others (`info`: its rank, its and the others' median wait), so the
        job runs at its pace. Once per episode."""

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


def decides_before_update(cb: Callback) -> bool:
    """The callback overrides `pre_update`: it must be heard before the update is applied."""
    return type(cb).pre_update is not Callback.pre_update
