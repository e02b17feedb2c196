"""`Intervention`: the run's record of a step it did not simply apply (an update refused, a
rollback, a halt), typed and frozen as the actions are (core/actions.py).

It is made in two places only: `Intervention.of` when the step's action is agreed (the step,
the action, what the spike guard saw), and, for a rollback, `RolledBack` by the restorer in one
call once the restore, the replay and the skips are done (core/restore.py). What leaves the loop
(checkpoints, the store, callbacks, `watch.interventions`, summaries) is its flat JSON record,
`record()`, the one shape every reader reads; `from_record` reads a record back (a checkpoint's),
and keeps the keys an older version wrote that this one does not know."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from spikewatch.trainer.core.actions import Action, Continue, Halt, Rollback, Spike
from spikewatch.trainer.core.callbacks import StepState
from spikewatch.trainer.core.decide import action_name

__all__ = ["Intervention", "RolledBack"]


@dataclass(frozen=True)
class RolledBack:
    """What a rollback did and found. The first fields every rollback has; the rest where they
    apply (None: not told, and absent from the record)."""

    from_step: int  # the step the run had reached
    to_step: int  # the step restored
    tier: str | None  # "memory" or "disk"
    restore_s: float
    skip_ranges: list[list[int]]  # the batches skipped from now on, [start, end)
    lr_scale: float  # this rollback's cut of the LR (1: none)
    lr_scale_after: float  # the run's scale of its schedule from now on
    dropped_checkpoints: list[int]  # the abandoned branch's
    skipped: str  # what was skipped, in the words every report uses (findings.skipped)
    restore_fallbacks: list[dict[str, Any]] | None = None  # targets that failed their checks
    check_s: float | None = None  # a host-memory snapshot's check
    replay_proof: dict[str, Any] | None = None  # the restored step replayed
    samples: list[dict[str, Any]] | None = None  # the rows named (attribution)
    attribution: dict[str, Any] | None = None  # what was measured to name them
    cause: str | None = None  # the replay's verdict (core/cause.py)
    cause_note: str | None = None
    replay_peak_loss: float | None = None
    control_peak_loss: float | None = None
    device_ranks: list[int] | None = None  # under torchrun: a device's fault
    device_step: int | None = None
    device_check: str | None = None
    device_losses: dict[str, Any] | None = None
    replay_steps: int | None = None
    replay_s: float | None = None
    suspect_devices: list[int] | None = None
    skipped_samples: int | None = None  # the named rows skipped in place of their batches
    batches_kept: list[list[int]] | None = None
    skipped_rows: list[list[int]] | None = None
    resumed_at_batch: int | None = None  # forward data flow: where the data goes on
    passed_over: int | None = None  # clean batches between the restored step and there


_ROLLED = tuple(f.name for f in fields(RolledBack))
_REQUIRED = tuple(f.name for f in fields(RolledBack) if f.default is not None)
_BASE = ("step", "batch_index", "kind", "reason", "loss", "grad_norm")
_SPIKE = tuple(Spike.__dataclass_fields__)


@dataclass(frozen=True)
class Intervention:
    """A step's non-Continue action as the run records it."""

    step: int
    batch_index: int
    kind: str  # action_name: "skip_update", "rollback", "halt"
    reason: str
    loss: float
    grad_norm: float
    spike: Spike | None = None  # what the spike guard saw, if it asked
    rolled_back: RolledBack | None = None  # a rollback's outcome, once carried out
    extra: Mapping[str, Any] = field(default_factory=dict)  # an older version's keys

    @classmethod
    def of(cls, action: Action, state: StepState) -> Intervention:
        """The record of `action` (not a Continue) decided on `state`."""
        assert not isinstance(action, Continue)
        return cls(
            step=state.step,
            batch_index=state.batch_index,
            kind=action_name(action),
            reason=action.reason,
            loss=state.loss,
            grad_norm=state.grad_norm,
            spike=action.spike if isinstance(action, Rollback | Halt) else None,
        )

    def record(self) -> dict[str, Any]:
        """The flat JSON record (a new dict): the spike's fields, the step's, the rollback's
        told fields, then any older version's keys."""
        out = {} if self.spike is None else self.spike.record()
        out.update((k, getattr(self, k)) for k in _BASE)
        if self.rolled_back is not None:
            rb = self.rolled_back
            out.update((k, v) for k in _ROLLED if (v := getattr(rb, k)) is not None)
        out.update(self.extra)
        return out

    @classmethod
    def from_record(cls, d: Mapping[str, Any]) -> Intervention:
        """The inverse of `record` (a checkpoint's records on resume)."""
        spike = Spike.from_record(d) if all(k in d for k in ("onset_step", "detect_step")) else None
        rolled = None
        if all(k in d for k in _REQUIRED):
            rolled = RolledBack(**{k: d[k] for k in _ROLLED if k in d})
        known = set(_BASE) | (set(_SPIKE) if spike is not None else set())
        known |= {k for k in _ROLLED if k in d} if rolled is not None else set()
        return cls(
            step=int(d["step"]),
            batch_index=int(d["batch_index"]),
            kind=str(d["kind"]),
            reason=str(d["reason"]),
            loss=d["loss"],
            grad_norm=d["grad_norm"],
            spike=spike,
            rolled_back=rolled,
            extra={k: v for k, v in d.items() if k not in known},
        )
