"""The step core: one training step, whoever runs the loop (ARCHITECTURE.md, "one step core").

Two clients drive it: the built-in trainer (trainer/builtin/loop.py), which brings its sampler,
faults, forward/backward and evaluation, and the `Watch` (trainer/watch.py), which brings the
user's model and the framework's gates. Per step, each client calls

    begin_step(index)   the batch's global index (the data position)
    gate(tensors)       after backward: reduce over ranks, the device step factor, the copy of
                        the step's values to the host enqueued -> a `Gate`
    (the client applies the update when the gate is open, with its factor)
    conclude()          the step's one host read, the callbacks' action (core/decide.py)
                        agreed by every rank, the record, then a rollback or a halt

With an optimizer that takes a step factor (trainer/model/optim/factor.py: spikewatch's AdamW,
the built-in Muon) the host reads nothing between backward and the update: a refused update is
applied as a factor of 0 on the device, and a rollback decided from the step's values happens
at its end, after the update (discarded with the rest by the restore). Otherwise, and when a
callback overrides `pre_update`, the core takes the host path: it reads the values in `gate`
and the callbacks decide before the update, which is then applied only if they let it.

and the core owns everything else: counters and the `DataState` with its skips, callbacks by
priority, rollback and restore, the checkpoint schedule, the one snapshot schema
(core/state.py) and resume with its check of what may change (core/lifecycle.py).

Data is a parameter, not a second copy: with `data_flow="rewind"` (the built-in trainer, which
draws any batch again from its index) a rollback restores the data position with the weights, so
the batches after the restored step are trained again unless skipped; with `"forward"` (the
Watch: the user's or the framework's data only flows forward) the position goes on, so every
batch between the restored step and the rollback is skipped, and a batch inside a skip range
that was drawn before the rollback decided it is refused when it comes (`SKIPPED_BATCH`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.strict_json import write_json
from spikewatch.trainer.checkpoints.format import Snapshot
from spikewatch.trainer.checkpoints.memory import AUTO_BUDGET, AUTO_STEPS
from spikewatch.trainer.checkpoints.staging import Stager
from spikewatch.trainer.checkpoints.tiers import DISK, Tiers
from spikewatch.trainer.core.actions import Action, Continue, Halt, Rollback, SkipUpdate
from spikewatch.trainer.core.attribution import Measure
from spikewatch.trainer.core.callbacks import (
    Callback,
    EvalState,
    FitState,
    StepState,
    decides_before_update,
)
from spikewatch.trainer.core.decide import action_name, decide, deliver_notes, rescale
from spikewatch.trainer.core.intervention import Intervention
from spikewatch.trainer.core.probes import Probes
from spikewatch.trainer.core.restore import Replay, Restorer, Swap
from spikewatch.trainer.core.same_step import AFTER_ROLLBACK, SameStepGate, step_factor
from spikewatch.trainer.core.state import DECIDED_KEYS, ENDED, RunState
from spikewatch.trainer.core.transfer import HostTransfer, StepTensors
from spikewatch.trainer.core.watchdog import BEGUN, GATED, RankBeats, StallConfig, Watchdog
from spikewatch.trainer.core.world import World, say
from spikewatch.trainer.model.optim.factor import StepFactor, factor_optimizer, optimizer_name

__all__ = [
    "APPLIED",
    "HALTED",
    "REFUSED",
    "ROLLED_BACK",
    "SKIPPED_BATCH",
    "Gate",
    "Replay",
    "Swap",
    "StepCore",
]

log = logging.getLogger(__name__)

# What a step came to. A client's LR schedule advances on the first two only.
APPLIED, REFUSED, ROLLED_BACK, HALTED = "applied", "refused", "rolled_back", "halted"
SKIPPED_BATCH = "skipped_batch"

_STOP = "_stop"  # rides the step's transfer under torchrun; never a metric
_FACTOR = "_factor"  # the step factor the device applied (1 applied, 0 refused); never a metric
_OVERFLOW = "_overflow"  # > 0: the GradScaler found inf/nan gradients; never a metric


@dataclass(frozen=True)
class Gate:
    """What the client does with a step's update: `open` = call the optimizer; `factor` = the
    device step factor its step folds in (None: the host has decided, on the host path)."""

    open: bool
    factor: torch.Tensor | None = None


@dataclass
class _Read:
    """A step's values on their way to the host, and what its StepState needs besides."""

    transfer: HostTransfer
    late_step: int | None  # the step of the update statistics riding along
    lr: float
    ntok: int
    step: int = 0
    batch_index: int = 0
    tokens: int = 0  # the run's tokens once this step is counted
    # read late: the same-step tier's inputs, on the device (loss, grad norm, factor, overflow)
    tier: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None


@dataclass
class StepCore:
    """Everything one step needs and every client shares. Built once, by core/setup.py's
    `open_core` for either client; the dataclass only assigns. Rollback, restore, resume and
    the snapshot schema are its `Restorer`'s (core/restore.py), which it holds."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    probes: Probes
    checkpointer: Tiers  # host memory and disk (trainer/checkpoints/tiers.py)
    world: World
    run: RunState
    callbacks: list[Callback]
    config: Callable[[], dict[str, Any]]  # the resolved config, as stored with the run
    data_flow: Literal["rewind", "forward"] = "rewind"
    scheduler: Any = None  # the client's LR scheduler, saved and restored with the run
    same_step: SameStepGate | None = None
    replay: Replay | None = None
    measure_rows: Measure | None = None  # the client's per-row measure, for attribution
    skip_samples: bool = False  # the client leaves single rows out: a rollback skips just those
    swap: Swap | None = None  # the client computes another rank's rows (the device check)
    max_steps: int | None = None
    stall: StallConfig | None = None  # the stall watchdog's settings (None: no watchdog)
    watchdog: Watchdog | None = None  # running from `start` to `settle`
    stop_asked: bool = False  # a signal arrived (under torchrun: not yet agreed on)
    stop_requested: bool = False
    stop_agreed: bool = False  # a signal's stop, agreed by every rank (a loop must end now)
    outcome: str = APPLIED
    metric_names: set[str] = field(default_factory=set)
    config_changes: dict[str, list[Any]] = field(default_factory=dict)
    resume_line: str | None = None  # a resume's one line, said at the start (`_say_resume`)
    host_path: bool = False  # read before the update (set from optimizer and callbacks)
    reads_late: bool = False  # a step's values read at the next step's end (probes.read, GPU)
    _in_flight: _Read | None = None  # the step read late: its values read at the next step's end
    _unapplied: set[int] = field(default_factory=set)  # late: steps the device refused
    _awaiting: int | None = None  # late: a host-memory snapshot of the step still in flight
    _disk_prepared: int = -1  # the optimizer's state count the disk tier's block was made for
    _stepper: StepFactor | None = None  # how the optimizer takes a step factor, if it does
    _read: _Read | None = None
    _step_tokens: int = 0  # the tokens of the step at the gate (0: not told)
    _applied: bool = False  # what the device did with the step's update
    _state: StepState | None = None
    _action: Action = field(default_factory=Continue)
    _last_step_end: float | None = None
    # refusals right after a rollback being told as one line: [first step, last step, more]
    _stretch: list[int] | None = None
    _started: bool = False
    _t0: float = field(default_factory=time.perf_counter)
    _steps_timed: int = 0

    def __post_init__(self) -> None:
        self.callbacks = sorted(self.callbacks, key=lambda c: -c.priority)
        self.restorer = Restorer(self)
        self._stepper = factor_optimizer(self.optimizer)
        before = [type(cb).__name__ for cb in self.callbacks if decides_before_update(cb)]
        mine = self._stepper is None or bool(before)
        # one path for all ranks: where one must read before the update, every rank does
        self.host_path = -self.world.min_int(-int(mine)) > 0
        read = self.probes.cfg.read
        cuda = self.probes.device.type == "cuda"
        self.reads_late = not self.host_path and (read == "next_step" or (read == "auto" and cuda))
        if self.reads_late and hasattr(self._stepper, "unsettled_allowed"):
            self._stepper.unsettled_allowed = 1  # type: ignore[union-attr]
        if self.host_path:
            why = (
                f"{optimizer_name(self.optimizer)} takes no step factor (spikewatch's AdamW and "
                "torch's AdamW(fused=True) do)"
                if self._stepper is None
                else f"callbacks {', '.join(before)} decide before the update (pre_update)"
                if before
                else "another rank's callbacks decide before the update"
            )
            log.log(  # a CPU's host is the device: nothing waits, nothing to say at start
                logging.WARNING if self.probes.device.type == "cuda" else logging.DEBUG,
                "the step's values are read before each update (%s): on a GPU the host "
                "waits for the backward every step",
                why,
            )

    # -- counters the clients read ------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Updates on the live branch (the step a checkpoint of now would carry)."""
        return self.run.step

    @property
    def halted(self) -> str | None:
        return self.run.halted

    @property
    def index(self) -> int:
        return self.run.index

    def take_index(self) -> int:
        """The next global batch index outside the skip ranges (advances the data position)."""
        return self.run.data.take()

    def next_index(self) -> int:
        """The next global batch index, in a skip range or not (advances the data position):
        the loop drew the batch itself, and `refuse_skipped` refuses one in a skip range."""
        return self.run.data.advance()

    # -- start ----------------------------------------------------------------------------------
    def start(self, anchor: bool = True) -> None:
        """Once, before the first step: callbacks hear of the run (and of a resume's changed
        settings), and the step-0 anchor is saved so that an early spike can roll back (not
        with `anchor=False`: a run that failed before its first step)."""
        if self._started:
            return
        self._started = True
        for cb in self.callbacks:
            cb.on_fit_start(self.fit_state())
        self._say_resume()
        if self.config_changes:
            for cb in self.callbacks:
                cb.on_config_change(self.step_count, self.config_changes)
            self.config_changes = {}
        if anchor and self.checkpointer.enabled and self.checkpointer.latest() is None:
            self.save()
        self._t0 = self._last_step_end = time.perf_counter()
        if self.stall is not None and self.stall.enabled:
            self.watchdog = Watchdog(
                self.stall, self._tell("on_stall"), self._tell("on_stall_end"),
                on_exit=self._persist_records,
                on_slowdown=self._tell("on_slowdown"),
                on_pace_back=self._tell("on_pace_back"),
                on_heartbeat=self._tell("on_heartbeat"),
                on_straggler=self._tell("on_straggler"),
                ranks=RankBeats.of_process_group() if self.world.size > 1 else None,
            )  # fmt: skip
            # FSDP2: every rank waits inside the collectives for the slowest, so its step,
            # forward and backward tell nothing; its arrivals at them do (the flight recorder)
            self.watchdog.arrivals = self.world.size > 1 and any(
                isinstance(p, DTensor) for p in self.probes.params
            )
            self.watchdog.start()

    def _say_resume(self) -> None:
        """A resume's one line: from where, and what is trained again (how far the process
        before got, where the run's record knows it: `Recorder.reached`)."""
        line, self.resume_line = self.resume_line, None
        if line is None or not self.world.is_main:
            return
        reached = [r for cb in self.callbacks if (r := getattr(cb, "reached", None)) is not None]
        step = self.step_count
        if reached and max(reached) > step:
            lost = max(reached) - step
            line += (
                f"; the process before recorded steps up to {max(reached)}: {lost} step"
                f"{'s' if lost != 1 else ''} at least trained again (its points stay in the record "
                "as an abandoned branch)"
            )
        else:
            line += "; steps after it are trained again"
        say(log, line)

    def _tell(self, hook: str) -> Callable[[Mapping[str, Any]], None]:
        def tell(info: Mapping[str, Any]) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(info)

        return tell

    def _persist_records(self) -> None:
        """Before a stalled process exits (the watchdog's thread): what was recorded, durable."""
        for cb in self.callbacks:
            persist = getattr(cb, "persist", None)
            if callable(persist):
                persist()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Work that is slow by nature (a checkpoint, an evaluation, a restore): the stall
        watchdog neither counts it as a stall nor into the run's pace."""
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    # -- the step -----------------------------------------------------------------------------
    def begin_step(self, index: int) -> None:
        """Before the step's first forward: `index` is its batch's global index. With forward
        data flow this is the client's (the framework's) data position."""
        self.start()
        self.run.index = index
        if self.watchdog is not None:  # for the other ranks: this one has its batch
            self.watchdog.mark(self.step_count + 1, BEGUN)
        if self.data_flow == "forward":
            self.run.data.batch_index = max(self.run.data.batch_index, index + 1)

    def gate(self, t: StepTensors, *, lr: float, ntok: int = 0) -> Gate:
        """After backward, before the update: reduce over ranks, the device step factor
        (non-finite values, the same-step tier), and the copy of the step's values to the host,
        enqueued. With a `FactorStep` optimizer nothing is read here: the update goes ahead
        with the factor folded in, and the values are read in `conclude`. Otherwise (the host
        path) they are read now and the callbacks decide before the update."""
        step = self.step_count + 1
        if self.watchdog is not None:  # at the step's reductions (others may wait here)
            self.watchdog.mark(step, GATED)
        t = self.world.reduce(t, stop=self.stop_asked)
        ahead = self._in_flight.tier if self._in_flight is not None else None
        refuse = None  # the factor's refusal flag, where its op makes it (a fused AdamW's)
        if self.same_step is not None and ahead is not None:  # the step before is on the device
            factor, refuse = self.same_step.factor_after(t.loss, t.grad_norm, ahead)
        else:
            limits = None if self.same_step is None else self.same_step.limits()
            factor = step_factor(t.loss, t.grad_norm, limits)
        xfer = HostTransfer()
        xfer.add_step(t)
        xfer.add([_FACTOR], factor)
        if self.probes.active(step):
            xfer.add_by_layer(*self.probes.grad_norms(t.grad_norms))
        pending = self.probes.take_pending()
        if pending is not None:
            pending.into(xfer, late=True)
        if t.stop is not None:
            xfer.add([_STOP], t.stop)
        if t.overflow is not None:
            xfer.add([_OVERFLOW], t.overflow)
        xfer.start()
        late_step = None if pending is None else pending.step
        tokens = self.run.tokens + ntok
        self._step_tokens = ntok  # the pace's unit (the watchdog's, at `conclude`)
        tier = (t.loss, t.grad_norm, factor, t.overflow) if self.reads_late else None
        self._read = _Read(xfer, late_step, lr, ntok, step, self.run.index, tokens, tier)
        if self.host_path:
            self._agree(self._take_read(self._this_read()))
            if self.outcome != APPLIED:
                return Gate(False)
            self._before_update(step)
            return Gate(True)
        self._before_update(step)
        assert self._stepper is not None
        self._stepper.set_step_factor(factor, refuse)
        return Gate(True, factor)

    def _before_update(self, step: int) -> None:
        ck = self.checkpointer
        ck.before_mutation()  # an async save may still be copying weights
        due = ck.enabled and bool(ck.due(step, self.seconds_per_step))
        self.probes.stagger_state(step, due)  # not a state step and a snapshot on one step
        self.probes.before_update(step)

    def _this_read(self) -> _Read:
        """The read this step's `gate` enqueued, taken (each is read once)."""
        read, self._read = self._read, None
        assert read is not None, "gate() was not called this step"
        return read

    def _take_read(self, read: _Read) -> StepState:
        """A step's one host read (its copy was enqueued in its `gate`) -> StepState."""
        metrics, late = read.transfer.fetch()
        if metrics.pop(_STOP, 0.0) > 0:  # a rank was signalled: all stop after this step
            self.stop_requested = self.stop_agreed = True
        refused = metrics.pop(_FACTOR) == 0.0
        loss, gnorm = metrics[M.LOSS], metrics[M.GRAD_NORM]
        # fp16: a GradScaler's overflow (finite loss, inf/nan gradients) is the scaler's to skip
        overflow = metrics.pop(_OVERFLOW, 0.0) > 0 and math.isfinite(loss)
        nonfinite = not (math.isfinite(loss) and (math.isfinite(gnorm) or overflow))
        refused_by = ""
        if self.same_step is not None and not overflow:
            refused_by = self.same_step.observe(loss, gnorm, refused and not nonfinite)
        if read.late_step is not None and read.late_step not in self._unapplied:
            self._emit_update_metrics(read.late_step, late)
        metrics[M.LR] = read.lr
        now = time.perf_counter()
        if read.ntok and self._last_step_end is not None:
            metrics[M.TOKENS_PER_S] = read.ntok / max(now - self._last_step_end, 1e-9)
        self._last_step_end = now
        self.metric_names.update(metrics)
        return StepState(
            step=read.step,
            batch_index=read.batch_index,
            loss=loss,
            ce=metrics.get(M.CE, loss),
            grad_norm=gnorm,
            clip_factor=metrics[M.CLIP_FACTOR],
            lr=read.lr,
            tokens=read.tokens,
            nonfinite=nonfinite,
            refused_by=refused_by,
            overflow=overflow,
            metrics=metrics,
        )

    def refuse_skipped(self) -> bool:
        """Forward data flow: True (and the step is `SKIPPED_BATCH`, nothing measured) when the
        step's batch lies in a skip range, drawn before the rollback that skips it. Every rank
        holds the same skip ranges, so every rank answers alike."""
        if self.data_flow == "forward" and self.run.data.skip_end(self.run.index) is not None:
            self.outcome, self._state, self._action = SKIPPED_BATCH, None, Continue()
            return True
        return False

    def _agree(self, state: StepState) -> None:
        """Rank 0's callbacks decide (core/decide.py); every rank carries out that one action,
        with the pins it asked for."""
        self._state = state
        proposal = decide(state, self.callbacks) if self.world.is_main else None
        action, pins = self.world.agree(proposal)
        refused = state.nonfinite or bool(state.refused_by) or state.overflow
        if isinstance(action, SkipUpdate) and not refused and not self.host_path:
            log.warning(
                "step %d: a callback asked to refuse an update that was already applied (%s); "
                "to refuse updates, override Callback.pre_update (the host path)",
                state.step,
                action.reason,
            )
            action = Continue()
        for reason in pins:
            self.pin_newest(reason)
        if isinstance(action, Continue):
            self._end_stretch()
            self.run.lr_scale = rescale(self.run.lr_scale, action)  # from the next step on
        else:
            self._say(state, action)
            self.run.interventions.append(Intervention.of(action, state))
            if isinstance(action, Halt):
                self.stop_requested = True
                self.run.halted = action.reason
        self._action = action
        # the host path applies only what continues; the device applied what it did not refuse
        kept = isinstance(action, Continue) and not state.overflow  # the scaler skips overflows
        self._applied = kept if self.host_path else not refused
        self.outcome = APPLIED if kept else REFUSED

    def _say(self, state: StepState, action: SkipUpdate | Rollback | Halt) -> None:
        """One console line an action; of a stretch of refusals right after a rollback (the
        rest of a bad stretch, up to 64 + 2 of them), the first, then one line when it ends. Each
        is in the run's record all the same."""
        stretch = isinstance(action, SkipUpdate) and action.reason.startswith(AFTER_ROLLBACK)
        if stretch and self._stretch is not None:
            self._stretch[1:] = [state.step, self._stretch[2] + 1]
            log.info("step %d: %s (%s)", state.step, action_name(action), action.reason)
            return
        self._end_stretch()
        log.warning("step %d: %s (%s)", state.step, action_name(action), action.reason)
        if stretch:
            self._stretch = [state.step, state.step, 0]

    def _end_stretch(self) -> None:
        """The stretch of refusals right after a rollback ended: how many more there were."""
        told, self._stretch = self._stretch, None
        if told is not None and told[2]:
            log.warning(
                "steps %d-%d: %d more updates refused right after the rollback, the bad stretch "
                "going on (each in the run's record)", told[0] + 1, told[1], told[2],
            )  # fmt: skip

    def conclude(self) -> str:
        outcome = self._conclude()
        if self.watchdog is not None:
            self.watchdog.beat(self.step_count, self._step_tokens)
        return outcome

    def _conclude(self) -> str:
        """After the update (or its refusal): the step's values are read (unless the host path
        read them before the update), the callbacks decide, the step is recorded and their
        notes delivered, then a rollback or a halt is carried out. Returns what the step came
        to.

        Read late (`late`, the GPU default): the step is counted now and its values stay on
        their way; the values of the step before, whose copy landed while the device computed
        this one, are read, decided on and recorded instead, and a rollback or halt they call
        for happens now, at this step's end. The device refused this step's update itself if
        it had to (the step factor); it returns 'applied' until its values are read."""
        if self.reads_late and self._read is not None:
            read = self._this_read()
            self.probes.after_update(read.step, True)  # dropped if the device refused it
            self.optimizer.zero_grad(set_to_none=True)
            self.run.step, self.run.tokens = read.step, read.tokens
            self._steps_timed += 1
            earlier, self._in_flight = self._in_flight, read
            self.outcome = APPLIED
            return APPLIED if earlier is None else self._conclude_read(earlier)
        if self._read is not None:
            self._agree(self._take_read(self._this_read()))
        state, action, self._state = self._state, self._action, None
        if state is None or self.outcome == SKIPPED_BATCH:
            return self.outcome
        if not self.host_path:
            assert self._stepper is not None
            self._stepper.settle(self._applied)  # what the device did, whatever comes next
        applied = self._applied and not isinstance(action, Rollback)
        self.probes.after_update(state.step, applied)
        self.optimizer.zero_grad(set_to_none=True)
        self.run.step, self.run.tokens = state.step, state.tokens
        self._steps_timed += 1
        return self._record(state, action, applied)

    def _conclude_read(self, read: _Read) -> str:
        """Read late: an earlier step's values -> the agreed action, the record, then the
        rollback or halt (at the current step's end)."""
        self._agree(self._take_read(read))
        state, action, self._state = self._state, self._action, None
        assert state is not None and self._stepper is not None
        self._stepper.settle(self._applied)
        if not self._applied:
            self._unapplied.add(state.step)  # its update statistics are not emitted
        self._unapplied = {s for s in self._unapplied if s >= state.step - 2}
        if isinstance(action, Rollback) and self._in_flight is not None:
            self._record_abandoned(state, action)
            self._awaiting = None  # newer than any rollback target: dropped with its branch
            return self.outcome
        outcome = self._record(state, action, self._applied and not isinstance(action, Rollback))
        if self._awaiting == state.step:
            self._settle_snapshot(state.step, self._applied and outcome == APPLIED)
        return outcome

    def _settle_snapshot(self, step: int, applied: bool) -> None:
        """The step of the host-memory snapshot taken while it was in flight is decided: an
        applied step's snapshot gets the state as decided (the guard's and the same-step tier's
        statistics, the records: what a drained snapshot would hold); a refused step's goes
        (the optimizer's step counts in it had counted the refused update)."""
        self._awaiting = None
        self.flush_probes(early_only=True)  # a disk save's copy (it landed with the step)
        if not applied:
            self.checkpointer.drop(step)
            return
        state = self.state_dict()
        decided = {k: state[k] for k in DECIDED_KEYS}
        self.checkpointer.complete(step, decided, {"loss": self.run.history[-1][1]})

    def _record_abandoned(self, state: StepState, action: Rollback) -> None:
        """A rollback decided from a step read late: that step's record (with the action),
        then the step in flight's (its values on the branch the rollback leaves: recorded, not
        decided on; its update settled as the device did it), then the rollback."""
        self._record(state, action, False, act=False)
        read, self._in_flight = self._in_flight, None
        assert read is not None and self._stepper is not None
        after = self._take_read(read)
        self._stepper.settle(not (after.nonfinite or after.refused_by or after.overflow))
        self.probes.discard_pending()  # the abandoned step's update statistics
        self._record(after, Continue(), False, act=False)
        self.rollback(action)

    def read_in_flight(self) -> str:
        """Read late: the step in flight is read, decided on and recorded now (one wait for
        its copy), as at a checkpoint and at the end of a run. Returns what it came to
        ('applied' when nothing was in flight)."""
        read, self._in_flight = self._in_flight, None
        if read is None:
            return APPLIED
        self.outcome = APPLIED
        return self._conclude_read(read)

    def _record(self, state: StepState, action: Action, applied: bool, act: bool = True) -> str:
        """A step's record (history, notes, callbacks), then its rollback or halt."""
        self.run.history.append((state.step, state.ce))  # the cross-entropy
        deliver_notes(self.callbacks)  # the verdicts that led to the action, before its record
        reason = "" if isinstance(action, Continue) else action.reason
        done = replace(state, applied=applied, action=action_name(action), reason=reason)
        for cb in self.callbacks:
            cb.post_step(done)
        if not act:
            return self.outcome
        if isinstance(action, Rollback):
            self.rollback(action)
        elif isinstance(action, Halt):
            self.outcome = HALTED
        return self.outcome

    # -- its checkpoints: the Restorer's (core/restore.py) ---------------------------------------
    def rollback(self, action: Rollback) -> None:
        """The one place a rollback is carried out: a rollback the step's callbacks decided and
        every rank agreed on, once the step's record is made (`_record`, or `_record_abandoned`
        for one decided from a step read late)."""
        with self.paused():  # a restore (and its replay) is no stall
            self.restorer.rollback(action)
        self.outcome = ROLLED_BACK

    def resume(self, check: Callable[[Path], dict[str, list[Any]]]) -> int:
        return self.restorer.resume(check)

    def state_dict(self, decided: bool = True) -> dict[str, Any]:
        return self.restorer.state_dict(decided)

    def load_state_dict(self, state: Mapping[str, Any], *, resume: bool = True) -> None:
        self.restorer.load_state_dict(state, resume=resume)

    def snapshot(self, stage: Stager | None, *, decided: bool = True) -> Snapshot:
        return self.restorer.snapshot(stage, decided=decided)

    def restore(self, loaded: dict[str, Any], *, resume: bool) -> None:
        self.restorer.restore(loaded, resume=resume)

    def request_stop(self) -> None:
        """From a signal handler: stop after this step. Under torchrun the request rides the
        next step's all-reduce first, so that every rank stops after the same step."""
        self.stop_asked = True
        if not self.world.distributed:
            self.stop_requested = self.stop_agreed = True

    def record_eval(self, val_loss: float) -> None:
        """A validation loss of the current step."""
        self.run.val_losses.append((self.step_count, val_loss))
        self.metric_names.add(M.VAL_LOSS)
        for cb in self.callbacks:
            cb.on_eval(EvalState(step=self.step_count, val_loss=val_loss))

    def _emit_update_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metric_names.update(metrics)
        for cb in self.callbacks:
            cb.on_update_metrics(step, metrics)
        deliver_notes(self.callbacks)

    def flush_probes(self, early_only: bool = False) -> None:
        """The waiting update statistics, now (one sync; none for those copied early): before
        a checkpoint, at the end. `early_only`: only those a disk save copied early."""
        while (pending := self.probes.take_pending_metrics(early_only)) is not None:
            if pending[0] not in self._unapplied:
                self._emit_update_metrics(*pending)

    # -- checkpoints ----------------------------------------------------------------------------
    def restart_clock(self) -> None:
        """Step timing (for the checkpoint schedule) counts from now: after set-up and resume."""
        self._t0 = time.perf_counter()

    @property
    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self._t0) / max(self._steps_timed, 1)

    def save_if_due(self) -> bool:
        """Save the current step if the schedule says so; True when it did."""
        ck = self.checkpointer
        due = ck.due(self.step_count, self.seconds_per_step) if ck.enabled else []
        if DISK in due and self._in_flight is not None and not ck.disk.awaits:
            # a file holds only steps read and decided: a synchronous or sharded save drains
            self.probes.start_pending()  # their copy enqueued first: the drain's wait covers it
            self.read_in_flight()
            due = ck.due(self.step_count, self.seconds_per_step)
        if due and self._in_flight is not None and self._awaiting is None:
            # the step in flight: no wait. Its decided state completes the snapshot when the
            # step is read (host memory keeps it as a target, the disk tier writes it), or
            # the snapshot goes if the step was refused. A file's update statistics are
            # copied now and emitted before it is written (`_settle_snapshot`).
            if DISK in due:
                self.probes.start_pending()
            self.save(due, awaiting=True)
            return True
        if due and self._in_flight is None:
            self.save(due)
            return True
        ck.report(self.callbacks)  # an asynchronous save that landed meanwhile
        if ck.memory is not None:
            ck.memory.ahead()  # the next snapshot's pinned block, prepared off the loop
        shapes = len(self.optimizer.state)  # the optimizer's state appears at its first step
        if ck.disk.enabled and self._disk_prepared != shapes:
            self._disk_prepared = shapes  # the disk tier's host block, made off the loop
            ck.disk.prepare(lambda stage: self.snapshot(stage, decided=False))
        return False

    def save(self, tiers: list[str] | None = None, *, awaiting: bool = False) -> None:
        """Checkpoint the current step to `tiers` (None: every tier that is on). A file's
        update statistics go out first, not with the next step's transfer: a resume from it
        never recomputes them (host memory is never resumed from: they ride the next transfer,
        no host read). `awaiting` (host memory, read late): the step is still in flight; the
        parts of its state that its decision changes are filled in once it is read
        (`_settle_snapshot`). What each tier cost the loop goes to the record."""
        ck = self.checkpointer
        if not awaiting:
            self.flush_probes()
        step = self.step_count

        def build(stage: Any) -> Any:
            return self.snapshot(stage, decided=not awaiting)

        with self.paused():
            stalls = ck.save(step, build, tiers, awaiting=awaiting)
        if awaiting:
            self._awaiting = step
        log.debug("checkpoint at step %d (loop blocked %s)", self.step_count, stalls)
        if DISK in stalls:
            path = ck.path_of(self.step_count, DISK)
            for cb in self.callbacks:
                cb.on_checkpoint(self.step_count, path, self.step_count in ck.pins)
        stats = {M.checkpoint_stall(tier): s for tier, s in stalls.items()}
        if ck.memory is not None:
            stats[M.CKPT_MEMORY_BYTES] = float(ck.memory.bytes_held)
            if ck.memory.auto:
                stats[M.CKPT_MEMORY_INTERVAL] = float(ck.memory.interval)
                self._tell_memory_interval()
        self._emit_update_metrics(self.step_count, stats)
        ck.report(self.callbacks)

    def _tell_memory_interval(self) -> None:
        """Say the host-memory tier's measured interval ('auto') once it is known, and again
        when it moves by half or more."""
        mem = self.checkpointer.memory
        if mem is None or mem.cost_s is None or not self.world.is_main:
            return
        told, now = mem.told, mem.interval
        if told is not None and max(now, told) < 1.5 * min(now, told):
            return
        mem.told = now
        lo, hi = AUTO_STEPS
        say(log, f"host-memory snapshots every {now} steps: one costs the loop "
            f"{1e3 * mem.cost_s:.1f} ms against a {1e3 * self.seconds_per_step:.1f} ms step "
            f"(at most {AUTO_BUDGET:.1%} of the time, between {lo} and {hi} steps)")  # fmt: skip

    def pin_newest(self, reason: str) -> None:
        if self.checkpointer.enabled:
            self.checkpointer.pin_newest(reason)

    # -- the end ----------------------------------------------------------------------------
    def finish(self, status: str) -> None:
        """The end of a run that did not fail: the last update statistics, the final
        checkpoint, then the callbacks hear how it ended."""
        self.start()
        try:
            self.read_in_flight()  # read late: the last step's values
            self._end_stretch()
            self.flush_probes()
            disk = self.checkpointer.disk
            if disk.enabled and disk.last_saved != self.step_count:
                self.save([DISK])
        finally:
            self.finish_pending()
        if self.world.is_main:  # a resume="auto" of this directory knows the run is over
            write_json(
                self.run.run_dir / ENDED,
                {"run_id": self.run.run_id, "status": status, "step": self.step_count},
            )
        for cb in self.callbacks:
            cb.on_fit_end(self.fit_state(status))

    def finish_pending(self) -> None:
        """Whatever happened: the waiting statistics out, the save in flight on disk (its
        error raised), the landed checkpoints told. Safe to call more than once."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        try:
            self.flush_probes()
        finally:
            self.checkpointer.wait()
            self.checkpointer.report(self.callbacks)

    def status(self) -> str:
        return "halted" if self.halted else "stopped" if self.stop_requested else "completed"

    def fit_state(self, status: str = "running") -> FitState:
        return FitState(
            run_id=self.run.run_id,
            run_dir=str(self.run.run_dir),
            step=self.step_count,
            max_steps=self.max_steps or 0,
            config=self.config(),
            status=status,
            resumed_from=self.run.resumed_from,
            val_loss=self.run.val_losses[-1][1] if self.run.val_losses else None,
        )

    def summary(self) -> dict[str, Any]:
        """The keys every client's summary JSON shares."""
        run = self.run
        return {
            "run_id": run.run_id,
            "run_dir": str(run.run_dir),
            "steps": self.step_count,
            "final_train_loss": run.history[-1][1] if run.history else run.resumed_loss,
            "final_val_loss": run.val_losses[-1][1] if run.val_losses else math.nan,
            "tokens": run.tokens,
            "skipped_batches": [list(r) for r in run.data.skip_ranges],  # what the data skips
            "skipped_samples": [list(p) for p in sorted(run.data.blocked)],  # (batch, row)
            "val_losses": [{"step": s, "loss": v} for s, v in run.val_losses],
            "interventions": [i.record() for i in run.interventions],
            "halted": run.halted,
            "metric_names": sorted(self.metric_names),
            "config": self.config(),
            **{k: v for cb in self.callbacks for k, v in cb.summary().items()},
        }
