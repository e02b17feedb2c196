"""From a verdict to an intervention: roll back to before the onset, skip the batches, escalate.

PaLM's recipe, automated, and pure (it sees the retained checkpoints and the step -> batch
maps it is given): the state is corrupted before the loss shows it, so the restore point lies
before the onset; the batches through the detection are skipped; repeats skip more, cut the
LR where the cause is the model's own state, and halt; a real new level is accepted. The
rules in full: docs/detection.md, "The policy's rules".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spikewatch.observatory.detect import Verdict

__all__ = ["Plan", "Policy", "PolicyConfig"]


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    margin: int = Field(1, ge=0, description="Restore a checkpoint < onset - margin.")
    skip_extra: int = Field(10, ge=0, description="Batches skipped past the detection step.")
    max_rollbacks: int = Field(3, ge=1, description="Repeated rollbacks before a clean halt.")
    max_state_rollbacks: int = Field(
        8,
        ge=1,
        description="The same after a spike whose replay found its cause in the optimizer "
        "state (each repeat cuts the LR, which is what cures those).",
    )
    repeat_window: int = Field(500, ge=1, description="Steps within which a spike is a repeat.")
    skip_growth: float = Field(2.0, ge=1, description="Extra-skip multiplier per repeat.")
    lr_decay: float = Field(0.5, gt=0, le=1, description="LR multiplier per repeat.")
    nonfinite_tolerance: int = Field(
        2, ge=1, description="Consecutive non-finite steps (refused) before a rollback."
    )
    accept_level_after: int = Field(
        2,
        ge=1,
        description="Rollbacks after which a spike that starts again where the skipped "
        "batches end, at the same level, is accepted as a new level (a data change).",
    )
    level_tolerance: float = Field(
        0.15, gt=0, description="Largest |log ratio| of two spikes' levels that is one level."
    )
    warning_horizon: int | None = Field(
        100,
        ge=1,
        description="Roll back to before a warning episode that began at most this many steps "
        "before the onset (and skip from there); None = before the onset only.",
    )


@dataclass(frozen=True)
class Plan:
    action: Literal["rollback", "halt", "skip", "accept", "none"]
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
        self.lr_cuts: list[int] = []  # detection steps of the rollbacks that cut the LR
        self.restored_at = 0  # the step of the last LR cut given back
        self.causes: dict[int, str] = {}  # detection step of a rollback -> its replay's cause
        # the last rollback, for telling a new level from a spike: the batch index its skip
        # ends at, the spike's loss level, and how many rollbacks in a row met that level
        self.shift: dict[str, Any] | None = None

    def plan(
        self,
        verdict: Verdict,
        *,
        checkpoints: Iterable[int],
        batch_of: Mapping[int, int],
        loss_of: Mapping[int, float] | None = None,
        warned_at: Iterable[int] = (),
    ) -> Plan:
        """`warned_at`: steps where warning episodes began (used with `warning_horizon`)."""
        if verdict.kind == "nonfinite":
            self.nonfinite_run.append(verdict.step)
            if len(self.nonfinite_run) < self.cfg.nonfinite_tolerance:
                return Plan("skip", f"non-finite at step {verdict.step}: update refused")
            onset = self.nonfinite_run[0]
            self.nonfinite_run = []
            return self._rollback(verdict, onset, checkpoints, batch_of, "repeated non-finite")
        if verdict.kind != "spike":
            return Plan("none", verdict.message)
        level = _level(verdict, loss_of or {})
        again = self._same_level_again(verdict, batch_of, level)
        if again >= self.cfg.accept_level_after:
            return self._accept(verdict, level, again)
        onset = start = verdict.onset_step
        if self.cfg.warning_horizon is not None:
            early = [w for w in warned_at if onset - self.cfg.warning_horizon <= w < onset]
            start = min(early, default=onset)
        plan = self._rollback(verdict, onset, checkpoints, batch_of, "loss spike", start=start)
        if plan.action == "rollback" and level is not None:
            cuts = (self.shift or {}).get("cuts", []) if again else []
            self.shift = {
                "skip_end": plan.skip_ranges[0][1],
                "level": level,
                "count": again,
                "rollbacks": [*(self.shift or {}).get("rollbacks", []), verdict.step][-again - 1 :],
                "cuts": [*cuts, verdict.step] if plan.lr_scale < 1 else cuts,
            }
        return plan

    def _same_level_again(
        self, verdict: Verdict, batch_of: Mapping[int, int], level: float | None
    ) -> int:
        """How many rollbacks in a row this spike makes, counting it, that came back right
        where the skipped batches end at the same level; 0 when it is not such a return."""
        if self.shift is None or level is None:
            return 0
        after = [s for s, b in batch_of.items() if b >= self.shift["skip_end"]]
        if not after or abs(verdict.onset_step - min(after)) > 2:
            return 0
        if abs(math.log(level / self.shift["level"])) > self.cfg.level_tolerance:
            return 0
        return int(self.shift["count"]) + 1

    def _accept(self, verdict: Verdict, level: float | None, again: int) -> Plan:
        assert self.shift is not None and level is not None
        shift, self.shift = self.shift, None
        ours = set(shift["rollbacks"])
        self.rollback_steps = [s for s in self.rollback_steps if s not in ours]
        self.lr_cuts = [s for s in self.lr_cuts if s not in shift["cuts"]]
        give_back = (1 / self.cfg.lr_decay) ** len(shift["cuts"])
        return Plan(
            "accept",
            f"the loss rose to {level:.4g} at step {verdict.onset_step} each time the skipped "
            f"batches ended ({again} rollbacks): a new level (a change in the data?), not a "
            "spike; the detector restarts its baseline there"
            + (
                f" and the LR cuts of those rollbacks are given back (x{give_back:g})"
                if shift["cuts"]
                else ""
            ),
            lr_scale=give_back,
            info={
                "onset_step": verdict.onset_step,
                "detect_step": verdict.step,
                "level": level,
                "rollbacks": sorted(ours),
                "kind": "level_shift",
            },
        )

    def caused(self, cause: str | None) -> None:
        """The cause the replay found for the last rollback ("state", "data_x_state",
        "transient", "unknown"; None: not replayed)."""
        if cause is not None and self.rollback_steps:
            self.causes[self.rollback_steps[-1]] = cause

    def recover(self, step: int) -> float:
        """An LR factor to give back one cut (1/lr_decay) once `repeat_window` steps passed
        since the last rollback and the last give-back; 1.0 otherwise. A cut made for a spike
        of the optimizer state is kept: at the full LR the instability comes straight back."""
        if not self.lr_cuts or self.causes.get(self.lr_cuts[-1]) == "state":
            return 1.0
        since = max([self.restored_at, *self.rollback_steps[-1:]])
        if step - since < self.cfg.repeat_window:
            return 1.0
        self.lr_cuts.pop()
        self.restored_at = step
        return 1 / self.cfg.lr_decay

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
        *,
        start: int | None = None,
    ) -> Plan:
        """Back to before `start` (the onset, or an earlier warning), skipping from there."""
        cfg = self.cfg
        start = onset if start is None else start
        recent = [s for s in self.rollback_steps if verdict.step - s <= cfg.repeat_window]
        state = cfg.lr_decay < 1 and any(self.causes.get(s) == "state" for s in recent)
        most = cfg.max_state_rollbacks if state else cfg.max_rollbacks
        info = {
            "onset_step": onset,
            "detect_step": verdict.step,
            "peak_step": verdict.peak_step,
            "score": verdict.score,
            "signal": verdict.signal,
            "repeats": len(recent),
        }
        if len(recent) >= most:
            advice = (
                "the replay found them in the optimizer state, not the data: lower the "
                "learning rate, or an Adam-type optimizer's beta2"
                if state
                else f"check the data near batch {batch_of.get(onset, '?')} or lower the "
                "learning rate"
            )
            return Plan(
                "halt",
                f"{what} at step {verdict.step} (onset {onset}) after "
                f"{len(recent)} rollbacks within {cfg.repeat_window} steps (at steps "
                f"{', '.join(map(str, recent))}): the spikes keep coming back; {advice} "
                "(a resume may change it: spikewatch train --resume RUN_DIR --set optim.lr=...)",
                info=info | {"state": state},
            )
        if start < onset:
            info["warning_step"] = start
        limit = start - cfg.margin
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
        grow = 0 if state else len(recent)  # skipping more cannot help a spike of the state
        extra = round(cfg.skip_extra * cfg.skip_growth**grow)
        skip = (batch_of[first], last + 1 + extra)
        why = self._lr_cut_why(recent)
        lr_scale = cfg.lr_decay if why else 1.0
        self.rollback_steps.append(verdict.step)
        if why:
            self.lr_cuts.append(verdict.step)
            info["lr_cut"] = why
        info.update(to_step=to_step, skip_ranges=[list(skip)], lr_scale=lr_scale)
        return Plan(
            "rollback",
            f"{what} at step {verdict.step}, onset {onset}: back to step {to_step}"
            + (f" (before the warning at step {start})" if start < onset else "")
            + (f"; the LR x{lr_scale:g} from now on: {why}" if why else ""),
            to_step=to_step,
            skip_ranges=(skip,),
            lr_scale=lr_scale,
            info=info,
        )

    def _lr_cut_why(self, recent: list[int]) -> str:
        """Why a repeat cuts the LR ("" when it does not): the response follows the cause.
        A spike that came back after a rollback whose replay found it in the model's state
        (or that could not tell, `unknown`) is the LR's to cure; after rollbacks whose spikes
        were the data's (`data_x_state`: the same batches make it again), a device's or
        transient, the skip is the cure and the LR stays."""
        if not recent:
            return ""
        causes = [self.causes.get(s) or "unknown" for s in recent]
        if "state" in causes:
            return "it came back after a rollback whose replay found it in the model's state"
        if all(c == "unknown" for c in causes):
            return "it came back and its cause is not known"
        return ""

    def state_dict(self) -> dict[str, Any]:
        return {
            "rollback_steps": self.rollback_steps,
            "nonfinite_run": self.nonfinite_run,
            "lr_cuts": self.lr_cuts,
            "restored_at": self.restored_at,
            "shift": self.shift,
            "causes": [[s, c] for s, c in self.causes.items()],
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rollback_steps = list(d["rollback_steps"])
        self.nonfinite_run = list(d["nonfinite_run"])
        self.lr_cuts = list(d.get("lr_cuts", []))
        self.restored_at = int(d.get("restored_at", 0))
        self.shift = d.get("shift")
        self.causes = {int(s): str(c) for s, c in d.get("causes", [])}


def _level(verdict: Verdict, loss_of: Mapping[int, float]) -> float | None:
    """The spike's loss level: the median loss from its onset to its detection."""
    vals = [loss_of[s] for s in range(verdict.onset_step, verdict.step + 1) if s in loss_of]
    vals = [v for v in vals if math.isfinite(v) and v > 0]
    return statistics.median(vals) if vals else None
