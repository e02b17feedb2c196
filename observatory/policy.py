"""From a verdict to an intervention: roll back to before the onset, skip the batches, escalate.

PaLM's recipe, automated: restore the newest retained checkpoint strictly before the onset
minus `margin` steps (the state is corrupted before the loss shows it: an LR-spike update at
step s raises the loss only at s+1, hence margin 1), and skip the batches from that step's
batch through the detection step's, plus `skip_extra` more. A spike within `repeat_window` steps
of the previous rollback is a repeat: the extra skip grows by `skip_growth` and the LR is scaled
by `lr_decay` each time; after `max_rollbacks` repeats the run halts with a message that says
why. Non-finite steps are refused by the loop; `nonfinite_tolerance` of them in a row roll back.
Pure: it sees the retained checkpoint steps and the step -> batch-index map it is given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from observatory.detect import Verdict

__all__ = ["Plan", "Policy", "PolicyConfig"]


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    margin: int = Field(1, ge=0, description="Restore a checkpoint < onset - margin.")
    skip_extra: int = Field(10, ge=0, description="Batches skipped past the detection step.")
    max_rollbacks: int = Field(3, ge=1, description="Repeated rollbacks before a clean halt.")
    repeat_window: int = Field(500, ge=1, description="Steps within which a spike is a repeat.")
    skip_growth: float = Field(2.0, ge=1, description="Extra-skip multiplier per repeat.")
    lr_decay: float = Field(0.5, gt=0, le=1, description="LR multiplier per repeat.")
    nonfinite_tolerance: int = Field(
        2, ge=1, description="Consecutive non-finite steps (refused) before a rollback."
    )


@dataclass(frozen=True)
class Plan:
    action: Literal["rollback", "halt", "skip", "none"]
    reason: str
    to_step: int | None = None
    skip_ranges: tuple[tuple[int, int], ...] = ()
    lr_scale: float = 1.0
    info: dict[str, Any] = field(default_factory=dict)


class Policy:
    def __init__(self, cfg: PolicyConfig | None = None) -> None:
        self.cfg = cfg or PolicyConfig()
        self.rollback_steps: list[int] = []  # detection steps of past rollbacks
        self.nonfinite_run: list[int] = []

    def decide(
        self, verdict: Verdict, *, checkpoints: Iterable[int], batch_of: Mapping[int, int]
    ) -> Plan:
        if verdict.kind == "nonfinite":
            self.nonfinite_run.append(verdict.step)
            if len(self.nonfinite_run) < self.cfg.nonfinite_tolerance:
                return Plan("skip", f"non-finite at step {verdict.step}: update refused")
            onset = self.nonfinite_run[0]
            self.nonfinite_run = []
            return self._rollback(verdict, onset, checkpoints, batch_of, "repeated non-finite")
        if verdict.kind != "spike":
            return Plan("none", verdict.message)
        return self._rollback(verdict, verdict.onset_step, checkpoints, batch_of, "loss spike")

    def finite(self) -> None:
        """A finite step ends a run of non-finite ones."""
        self.nonfinite_run = []

    def _rollback(
        self,
        verdict: Verdict,
        onset: int,
        checkpoints: Iterable[int],
        batch_of: Mapping[int, int],
        what: str,
    ) -> Plan:
        cfg = self.cfg
        recent = [s for s in self.rollback_steps if verdict.step - s <= cfg.repeat_window]
        info = {
            "onset_step": onset,
            "detect_step": verdict.step,
            "peak_step": verdict.peak_step,
            "score": verdict.score,
            "signal": verdict.signal,
            "repeats": len(recent),
        }
        if len(recent) >= cfg.max_rollbacks:
            return Plan(
                "halt",
                f"{what} at step {verdict.step} (onset {onset}) after "
                f"{len(recent)} rollbacks within {cfg.repeat_window} steps (at steps "
                f"{', '.join(map(str, recent))}): the spikes keep coming back; check the "
                f"data near batch {batch_of.get(onset, '?')} or lower the learning rate",
                info=info,
            )
        limit = onset - cfg.margin
        before = [c for c in checkpoints if c < limit]
        if not before:
            return Plan(
                "halt",
                f"{what} at step {verdict.step} (onset {onset}): no retained "
                f"checkpoint before step {limit} to roll back to",
                info=info,
            )
        to_step = max(before)
        first = min((s for s in batch_of if s > to_step and s >= limit), default=None)
        last = batch_of.get(verdict.step)
        if first is None or last is None:
            return Plan(
                "halt",
                f"{what} at step {verdict.step}: the batches of steps {limit}.."
                f"{verdict.step} are unknown, so no skip can be planned",
                info=info,
            )
        extra = round(cfg.skip_extra * cfg.skip_growth ** len(recent))
        skip = (batch_of[first], last + 1 + extra)
        lr_scale = cfg.lr_decay if recent else 1.0
        self.rollback_steps.append(verdict.step)
        info.update(to_step=to_step, skip_ranges=[list(skip)], lr_scale=lr_scale)
        return Plan(
            "rollback",
            f"{what} at step {verdict.step}, onset {onset}: back to step "
            f"{to_step}, skipping batches [{skip[0]}, {skip[1]})",
            to_step=to_step,
            skip_ranges=(skip,),
            lr_scale=lr_scale,
            info=info,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"rollback_steps": self.rollback_steps, "nonfinite_run": self.nonfinite_run}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rollback_steps = list(d["rollback_steps"])
        self.nonfinite_run = list(d["nonfinite_run"])
