"""The trainer's side of the observatory: the one callback that detects spikes and acts.

Every step, once its values reach the host, it feeds the detector (loss, grad norm, probes' leading
signals) and turns a verdict into an action through the policy: `Rollback` to a retained
checkpoint from before the onset with the offending batches skipped, `Halt` when spikes keep
coming back, `Continue(pin=...)` to keep a pre-spike anchor when a leading signal warns. It
restarts the detector's baseline at known regime changes (mixture stages, the WSD decay), which
the trainer's config tells it, and records every verdict and the outcome of each rollback: the
loss when the new branch passes the detection step, against the pre-spike level.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.detect import Detector, Verdict
from spikewatch.observatory.policy import Policy
from spikewatch.observatory.ranks import departed_ranks
from spikewatch.trainer.checkpoints.tiers import ANCHOR
from spikewatch.trainer.config import GuardConfig, TrainConfig
from spikewatch.trainer.core.actions import (
    Action,
    Continue,
    Halt,
    Note,
    Rollback,
    SkipUpdate,
    Spike,
)
from spikewatch.trainer.core.callbacks import Callback, StepState

__all__ = ["SpikeGuard", "regime_steps"]

log = logging.getLogger(__name__)
_RANK0 = M.rank_loss(0)  # a step with per-rank losses has rank 0's


def regime_steps(cfg: TrainConfig) -> list[int]:
    """Steps where the loss may legitimately change level: stage switches, the WSD decay."""
    steps = [s.until_step for s in cfg.data.stages if s.until_step is not None]
    if cfg.schedule.name == "wsd":
        decay = max(1, round(cfg.schedule.decay_fraction * cfg.train.max_steps))
        steps.append(max(cfg.schedule.warmup_steps, cfg.train.max_steps - decay) + 1)
    return sorted(set(steps))


class SpikeGuard(Callback):
    priority = 50  # after sinks that only record, before the progress bar

    def __init__(
        self,
        guard: GuardConfig,
        retained: Callable[[], list[int]],
        *,
        warmup_steps: int = 0,
        regimes: Iterable[int] = (),
        can_roll_back: bool = True,
    ) -> None:
        """`retained`: the steps of the checkpoints a rollback can go to (asked only when a
        spike is acted on); `warmup_steps`: the detector ignores them (the loss falls too fast
        to have a level);
        `regimes`: steps where the loss may change level legitimately; `can_roll_back`: the
        run keeps checkpoints (without them a verdict is recorded, never acted on)."""
        warm = max(guard.detector.ignore_before, warmup_steps)
        self.detector = Detector(guard.detector.model_copy(update={"ignore_before": warm}))
        self.policy = Policy(guard.policy)
        self.act = guard.rollback and can_roll_back
        self.retained = retained
        self.regimes = set(regimes)
        self.batch_of: dict[int, int] = {}
        self.loss_of: dict[int, float] = {}
        self.rank_loss_of: dict[int, list[float]] = {}  # step -> each rank's own loss
        self.classify = guard.classify_cause
        self.verdicts: list[dict[str, Any]] = []
        self.watching: list[tuple[Spike, float]] = []  # rollbacks awaiting their outcome
        self.outcomes: list[dict[str, Any]] = []
        self._notes: list[Note] = []
        self._pin: str | None = None
        self._warned: dict[str, int] = {}  # signal -> last step it warned
        self._episodes: list[int] = []  # steps where warning episodes began (recent ones)
        # a rollback restored weights known good and no step has been learnt since: a step the
        # same-step tier refuses then is the rest of a bad stretch on those weights, which the
        # detector must not take for the model spiking again (a second rollback, an LR cut)
        self._restored = False
        self._keep = 4 * (guard.detector.window + guard.policy.skip_extra) + 64

    @classmethod
    def for_config(cls, cfg: TrainConfig, retained: Callable[[], list[int]]) -> SpikeGuard:
        """The built-in trainer's guard: warmup, stage switches, WSD decay from its config."""
        return cls(
            cfg.guard,
            retained,
            warmup_steps=cfg.schedule.warmup_steps,
            regimes=regime_steps(cfg),
            can_roll_back=cfg.checkpoint.any_tier,
        )

    def on_step(self, state: StepState) -> Action:
        if state.overflow:  # fp16: the GradScaler skipped it and lowers its scale; not a signal
            return Continue()
        if state.step in self.regimes:
            self.detector.rebase(state.step)
        self.batch_of[state.step] = state.batch_index
        self.loss_of[state.step] = state.loss
        per_rank = (  # under torchrun: each rank's own loss, in rank order
            [v for k, v in state.metrics.items() if k.startswith("rank/")]
            if _RANK0 in state.metrics
            else None
        )
        if per_rank:
            self.rank_loss_of[state.step] = per_rank
        for s in [s for s in self.batch_of if s < state.step - self._keep]:
            del self.batch_of[s]
            self.loss_of.pop(s, None)
            self.rank_loss_of.pop(s, None)
        if self._restored:
            if state.refused_by:  # refused on the restored weights: the data's, not a spike
                return Continue()
            self._restored = False
        self._outcomes(state)
        level = self.detector.level()
        verdicts = self.detector.update(state.step, state.loss, state.grad_norm)
        verdicts += self.detector.observe(state.step, state.metrics)
        if not state.nonfinite:
            self.policy.finite()
        pin, self._pin = self._pin, None
        action: Action | None = None
        for v in verdicts:
            if v.kind == "warning":
                if self._new_episode(v):
                    self._record(v)
                    pin = pin or f"{ANCHOR}: {v.message}"
                continue
            self._record(v)
            log.info("step %d: %s verdict (%s)", state.step, v.kind, v.message)
            if v.kind in ("spike", "nonfinite") and self.act and action is None:
                action = self._act(v, level)
        if action is not None:
            return action
        give_back = self.policy.recover(state.step) if self.act else 1.0
        if give_back != 1.0:
            message = (
                f"{self.policy.cfg.repeat_window} calm steps since the last rollback: one LR "
                f"cut given back (x{give_back:g})"
            )
            log.warning("step %d: %s", state.step, message)  # said as the cut was
            self._note(state.step, message, {"kind": "lr_restore", "lr_factor": give_back})
        return Continue(pin=pin, lr_scale=give_back)

    def _new_episode(self, v: Verdict) -> bool:
        """A warning that did not fire on the previous step too: only these are recorded and
        pin an anchor (a logit that stays above the threshold would otherwise pin every
        checkpoint and defeat retention)."""
        last = self._warned.get(v.signal)
        self._warned[v.signal] = v.step
        if last is None or v.step - last > 1:
            log.info("step %d: warning (%s)", v.step, v.message)
            self._episodes = [s for s in self._episodes if s > v.step - self._keep] + [v.step]
            return True
        return False

    def _act(self, v: Verdict, level: float | None) -> Action:
        plan = self.policy.plan(
            v,
            checkpoints=self.retained(),
            batch_of=self.batch_of,
            loss_of=self.loss_of,
            warned_at=self._episodes,
        )
        if plan.action == "accept":  # a new level: the baseline restarts at its onset
            self.detector.rebase(v.onset_step)
            log.warning("step %d: %s", v.step, plan.reason)
            self._note(v.step, plan.reason, plan.info)
            return Continue(lr_scale=plan.lr_scale)
        spike = Spike(
            onset_step=plan.info.get("onset_step", v.onset_step),
            detect_step=v.step,
            peak_step=v.peak_step,
            score=v.score,
            signal=v.signal,
            repeats=int(plan.info.get("repeats", 0)),
            pre_spike_loss=level,
            peak_loss=self.loss_of.get(v.peak_step, self.loss_of.get(v.step)),
            ranks=tuple(departed_ranks(self.rank_loss_of, v.onset_step, v.step)),
        )
        if plan.action == "halt":
            return Halt(plan.reason, spike=spike)
        if plan.action == "skip":
            return SkipUpdate(plan.reason)
        if plan.action != "rollback" or plan.to_step is None:
            return Continue()
        # each rank's own loss over the steps rolled back (torchrun), in every client
        rolled = sorted(s for s in self.rank_loss_of if plan.to_step < s <= v.step)
        spike = replace(spike, rank_losses=tuple((s, tuple(self.rank_loss_of[s])) for s in rolled))
        if self.classify:
            steps = [s for s in sorted(self.batch_of) if plan.to_step < s <= v.step]
            good = [self.batch_of[s] for s in sorted(self.batch_of) if s <= plan.to_step]
            good = good[-len(steps) :] if len(good) >= len(steps) else []
            spike = replace(
                spike,
                replay=tuple((s, self.batch_of[s]) for s in steps),
                control=tuple(zip(steps, good, strict=False)),
            )
        if level is not None:
            self.watching.append((spike, level))
        return Rollback(
            to_step=plan.to_step,
            skip_ranges=plan.skip_ranges,
            lr_scale=plan.lr_scale,
            reason=plan.reason,
            spike=spike,
        )

    def _outcomes(self, state: StepState) -> None:
        for spike, level in list(self.watching):
            if state.step > spike.detect_step:
                outcome = {
                    "detect_step": spike.detect_step,
                    "onset_step": spike.onset_step,
                    "pre_spike_loss": level,
                    "recovered_at_step": state.step,
                    "loss_delta": state.loss - level,
                    "outcome": "recovered" if state.loss <= level * 1.05 else "degraded",
                }
                self.watching.remove((spike, level))
                self.outcomes.append(outcome)
                note = f"rollback outcome: {outcome['outcome']}"
                self._note(state.step, note, {**outcome, "kind": "outcome"})

    def _note(self, step: int, message: str, data: Mapping[str, Any]) -> None:
        self._notes.append(Note(step, "note", message, dict(data)))

    def take_notes(self) -> list[Note]:
        out, self._notes = self._notes, []
        return out

    def on_update_metrics(self, step: int, metrics) -> None:
        for v in self.detector.observe(step, metrics):
            if self._new_episode(v):
                self._record(v)
                self._pin = f"{ANCHOR}: {v.message}"

    def _record(self, v: Verdict) -> None:
        """A verdict for the summary and the record: spikes and non-finite values as such, the
        rest (warnings, divergence) as notes."""
        data = v.to_dict()
        if v.kind in ("spike", "nonfinite") and self.rank_loss_of:
            data["ranks"] = departed_ranks(self.rank_loss_of, v.onset_step, v.step)
        self.verdicts.append(data)
        kind = v.kind if v.kind in ("spike", "nonfinite") else "note"
        self._notes.append(Note(v.step, kind, v.message, data))

    def on_restore(self, step: int, saved: Mapping[str, Any]) -> None:
        """The detector's statistics as the restored checkpoint had them: the run's window of
        losses and gradient norms up to `step`. Rewinding the live window instead kept only
        its points up to `step`, fewer than it needs to judge when the rollback reached back
        far (the guard was blind for the first steps after it, and took the bad ones into its
        level). What the run learned since (the policy, the baseline restarts) stays."""
        if "detector" in saved:
            self.detector.restore_series(saved["detector"])

    def on_rollback(self, step: int, record: Mapping[str, Any]) -> None:
        self.detector.rewind(step)
        self._restored = True
        if record.get("kind") == "rollback":
            self.policy.caused(record.get("cause"))
        # the restored branch has not seen the warnings raised after `step`: a warning there
        # starts a new episode (and pins a new anchor)
        self._warned = {k: s for k, s in self._warned.items() if s <= step}
        self._episodes = [s for s in self._episodes if s <= step]
        for s in [s for s in self.batch_of if s > step]:
            del self.batch_of[s]
            self.loss_of.pop(s, None)
            self.rank_loss_of.pop(s, None)

    def summary(self) -> dict[str, Any]:
        return {"verdicts": self.verdicts, "outcomes": self.outcomes}

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
            "batch_of": [[s, b] for s, b in self.batch_of.items()],
            "loss_of": [[s, v] for s, v in self.loss_of.items()],
            "rank_loss_of": [[s, v] for s, v in self.rank_loss_of.items()],
            "verdicts": self.verdicts,
            "watching": [[spike.record(), level] for spike, level in self.watching],
            "outcomes": self.outcomes,
            "warned": self._warned,
            "episodes": self._episodes,
            "restored": self._restored,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        now = self.detector.cfg  # this run's settings (a resume may change them) ...
        self.detector.load_state_dict(state["detector"])
        then = self.detector.cfg  # ... with the baseline restarts the run has made
        self.detector.cfg = now.model_copy(
            update={"ignore_before": max(now.ignore_before, then.ignore_before)}
        )
        self.policy.load_state_dict(state["policy"])
        self.batch_of = {int(s): int(b) for s, b in state["batch_of"]}
        self.loss_of = {int(s): float(v) for s, v in state["loss_of"]}
        self.rank_loss_of = {
            int(s): [float(x) for x in v] for s, v in state.get("rank_loss_of", [])
        }
        self.verdicts = list(state["verdicts"])
        self.watching = [(Spike.from_record(r), float(lv)) for r, lv in state.get("watching", [])]
        self.outcomes = list(state.get("outcomes", []))
        self._warned = {str(k): int(s) for k, s in state.get("warned", {}).items()}
        self._episodes = [int(s) for s in state.get("episodes", [])]
        self._restored = bool(state.get("restored", False))
