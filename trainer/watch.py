"""`Watch`: spikewatch's loop around training it does not own (a plain loop, HF, Lightning).

It gives the user's model, optimizer and LR scheduler what the built-in trainer has, through
the same pieces: `Probes` (named by the model's own modules), `SpikeGuard` (detector, policy),
`Recorder` (the store), `Checkpointer` (retention, pins) and `decide.propose`.

One step, whoever runs the loop:
  begin_step(index)  the batch's global index; a due checkpoint of the previous step is saved
  observe_loss(loss) once per forward (micro-batch), on device
  decide()           after backward, before optimizer.step: clip (measuring the norm first),
                     one host transfer, the callbacks' decision; True = apply the update
  conclude()         record the step; carry out a rollback (in-process restore) or a halt
A plain loop calls `step(loss)`, which does the last three; a framework's optimizer and
scheduler are routed through `gate`, so the framework's own `optimizer.step()` asks first.

Data flows forward. The user's (or the framework's) data position keeps going after a
rollback: the batches between the restored step and the detection step are never trained on
again, which skips them, and the policy's further skip ranges are refused as they come (or,
with `batches`, never drawn). The Watch's step counts the updates of the live branch and
drives the scheduler, so a rolled-back run still ends after `max_steps` updates.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from observatory import metric_names as M
from observatory.store.sink import BaseSink, open_run_sink
from observatory.strict_json import write_json
from trainer.builtin.data import DataState
from trainer.builtin.step import HostTransfer, clip_by_global_norm
from trainer.checkpoints.disk import Checkpointer
from trainer.checkpoints.format import Snapshot
from trainer.checkpoints.format import list_checkpoints as ck_list
from trainer.checkpoints.staging import Stager, to_host
from trainer.config import ConfigError, WatchSettings
from trainer.core.actions import Action, Continue, Halt, Rollback
from trainer.core.callbacks import Callback, EvalState, FitState, StepState
from trainer.core.decide import action_name, deliver_notes, intervention, propose, rescale
from trainer.core.guard import SpikeGuard
from trainer.core.probes import Probes, describe_model, module_layer_of
from trainer.core.recorder import Recorder
from trainer.core.same_step import SameStepGate
from trainer.core.state import (
    callback_keys,
    join_optimizer,
    rng_states,
    set_rng_states,
    split_optimizer,
)
from trainer.model.attention import AttnMax

__all__ = ["Watch"]

log = logging.getLogger(__name__)

# What a step came to: the scheduler advances on the first two only.
APPLIED, REFUSED, ROLLED_BACK, HALTED = "applied", "refused", "rolled_back", "halted"
SKIPPED_BATCH = "skipped_batch"


class Watch:
    """Probes, spike guard, retained checkpoints and rollback for the user's own training.

    `Watch(model, optimizer, scheduler)` is enough: the run goes to the store beside
    `runs/` (or `db`, or $SPIKEWATCH_DB_URL) and checkpoints to `runs/<run id>/`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        name: str | None = None,
        db: str | None = None,
        run_dir: str | Path | None = None,
        max_steps: int | None = None,
        grad_clip: float | None = None,
        warmup_steps: int | None = None,
        checkpoint_every: int | None = None,
        settings: WatchSettings | Mapping[str, Any] | None = None,
        resume: bool = False,
        state: Mapping[str, Any] | None = None,
        tags: Sequence[str] = (),
        sink: BaseSink | None = None,
        layer_of: Callable[[str], str] = module_layer_of,
        framework: str = "loop",
        model_info: Mapping[str, Any] | None = None,
    ) -> None:
        """`settings`: a `WatchSettings` (or its dict) for everything; the keywords override
        it. `resume`: continue from the newest intact checkpoint in `run_dir`. `state`: a
        `state_dict()` saved in a framework's own checkpoint (its resume restores the rest)."""
        from trainer.builtin.loop import new_run_id  # the run id rule of the built-in trainer

        cfg = WatchSettings.build(
            settings, name, max_steps, grad_clip, warmup_steps, checkpoint_every
        )
        if resume and run_dir is None:
            raise ValueError("resume needs the run directory")
        self.cfg = cfg
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.run_id = Path(run_dir).name if run_dir else new_run_id(cfg.name)
        if state is not None:
            self.run_id = str(state["run_id"])
        self.run_dir = Path(run_dir) if run_dir else Path("runs") / self.run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.framework = framework
        self.model_info = dict(model_info or describe_model(model))
        self.sink = sink if sink is not None else open_run_sink(self.run_dir, db)
        self.recorder = Recorder(self.sink, tags=list(tags))
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint, before_commit=self.recorder.persist
        )
        self.checkpointer.open()
        self.guard = SpikeGuard(
            cfg.watch,
            self.checkpointer.retained,
            warmup_steps=cfg.warmup_steps,
            can_roll_back=cfg.checkpoint.interval is not None,
        )
        self.callbacks: list[Callback] = [self.recorder, self.guard]
        self.probes = Probes(model, optimizer, cfg.probes, layer_of=layer_of)
        if not self.model_info.get("n_layer"):  # no HF config: count the numbered blocks
            blocks = {la.split("/")[0] for la in self.probes.layers}
            self.model_info["n_layer"] = sum(b.isdigit() for b in blocks)
        self.attn = AttnMax()
        self.device = self.probes.params[0].device
        tier = cfg.watch.same_step
        self.same_step = SameStepGate(tier, self.device) if tier.enabled else None
        self.step_count = 0  # updates on the live branch
        self.data = DataState()  # the data position (next global batch index) and skips
        self.index = 0  # this step's batch index
        self.lr_scale = 1.0
        self.generation = 0  # rollbacks carried out (see trainer/checkpoint.find_intact)
        self.interventions: list[dict[str, Any]] = []
        self.history: list[tuple[int, float]] = []
        self.val_losses: list[tuple[int, float]] = []
        self.metric_names: set[str] = set()
        self.halted: str | None = None
        self.outcome = APPLIED
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self._loss_share: torch.Tensor | None = None
        self._state: StepState | None = None
        self._action: Action = Continue()
        self._started = self._began = self._closed = False
        self._t0 = time.perf_counter()
        if resume:
            self._resume()
        elif state is not None:
            self.load_state_dict(state)
            self.checkpointer.drop_after(self.step_count)  # the future of an abandoned timeline
        elif ck_list(self.checkpointer.root):
            raise ConfigError(
                f"{self.run_dir} already holds checkpoints of a run: resume it "
                "(resume=True) or choose another run directory"
            )

    # -- the user's loop ------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        return self.halted is not None or (
            self.cfg.max_steps is not None and self.step_count >= self.cfg.max_steps
        )

    def batches(self, batch_at: Callable[[int], Any]) -> Iterator[Any]:
        """`batch_at(index)` for each global batch index from the data position on, skipping
        the skip ranges, until `max_steps` updates (or a halt)."""
        while not self.should_stop:
            self.begin_step(self.take_index())
            yield batch_at(self.index)

    def take_index(self) -> int:
        """The next global batch index outside the skip ranges (advances the data position)."""
        return self.data.take()

    def step(self, loss: torch.Tensor | None = None) -> str:
        """A plain loop's whole step after `loss.backward()`: measure, decide, apply or refuse,
        advance the scheduler, zero the gradients. Returns what the step came to: 'applied',
        'refused' (a non-finite or refused update), 'rolled_back', 'halted' or
        'skipped_batch'."""
        if loss is not None:
            self.observe_loss(loss)
        if self.decide():
            self.apply(self.optimizer.step)
        self.conclude()
        if self.scheduler is not None and self.outcome in (APPLIED, REFUSED):
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._save_if_due()
        return self.outcome

    def log_eval(self, val_loss: float) -> None:
        """A validation loss of the current step (shown on the run page, kept in the summary)."""
        self._start()
        self.val_losses.append((self.step_count, float(val_loss)))
        self.metric_names.add(M.VAL_LOSS)
        for cb in self.callbacks:
            cb.on_eval(EvalState(step=self.step_count, val_loss=float(val_loss)))

    # -- the step, in phases (frameworks call these from their hooks) ----------------------
    def begin_step(self, index: int | None = None) -> None:
        """Before the step's first forward: `index` is the batch's global index (a framework's
        own data position); the checkpoint due for the previous step is saved first."""
        self._start()
        self._save_if_due()
        if index is not None:
            self.index = index
            self.data.batch_index = index + 1
        self._loss_sum, self._loss_n, self._loss_share = None, 0, None
        self.attn.active = self.probes.wants_attn_max(self.step_count + 1)
        self._began = True

    def observe_loss(self, loss: torch.Tensor, *, share: bool = False) -> None:
        """The loss of one forward (one micro-batch); the step's loss is their mean. With
        `share`, the loss was already divided by the whole step's token count (Hugging Face's
        `num_items_in_batch`), so the step's loss is the sum of the shares."""
        value = loss.detach().float()
        if share:
            self._loss_share = value if self._loss_share is None else self._loss_share + value
            return
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_n += 1

    def decide(self) -> bool:
        """After backward, before the optimizer step. True = apply the update."""
        if not self._began:
            self.begin_step(self.take_index())
        self._began = False
        if self.data.skip_end(self.index) is not None:  # drawn before the rollback that skips it
            self.outcome = SKIPPED_BATCH
            return False
        step = self.step_count + 1
        state = self._measure(step)
        action, pins = propose(state, self.callbacks)
        deliver_notes(self.callbacks)
        for reason in pins:
            self._pin_newest(reason)
        if isinstance(action, Continue):
            self.lr_scale = rescale(self.lr_scale, action)  # from this update on
        else:
            log.warning("step %d: %s (%s)", step, action_name(action), action.reason)
            self.interventions.append(intervention(action, state))
        self._state, self._action = state, action
        self.outcome = APPLIED if isinstance(action, Continue) else REFUSED
        if self.outcome == APPLIED:
            self.checkpointer.before_mutation()
            self.probes.before_update(step)
        return self.outcome == APPLIED

    def apply(self, optimizer_step: Callable[[], Any]) -> None:
        """Run the optimizer's step with the rollback LR scale (restored after it, so the
        scheduler's own arithmetic is untouched)."""
        if self.lr_scale == 1.0:
            optimizer_step()
            return
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * self.lr_scale
        try:
            optimizer_step()
        finally:
            for g, lr in zip(groups, saved, strict=True):
                g["lr"] = lr

    def conclude(self) -> None:
        """After the optimizer step (or its refusal): record, then roll back or halt."""
        if self.outcome == SKIPPED_BATCH or self._state is None:
            return
        state, action = self._state, self._action
        applied = self.outcome == APPLIED
        self.probes.after_update(state.step, applied)
        self.step_count = state.step
        self.history.append((state.step, state.loss))
        reason = "" if isinstance(action, Continue) else action.reason
        done = replace(state, applied=applied, action=action_name(action), reason=reason)
        for cb in self.callbacks:
            cb.post_step(done)
        self._state = None
        if isinstance(action, Rollback):
            self._rollback(action)
            self.outcome = ROLLED_BACK
        elif isinstance(action, Halt):
            self.halted = action.reason
            self.outcome = HALTED

    def gate(self, optimizer: Any, scheduler: Any = None) -> None:
        """Route a framework's `optimizer.step()` (with or without a closure, as Lightning
        calls it) and `scheduler.step()` through the Watch: the update happens only if the
        Watch decides so, and the scheduler follows the Watch's steps."""
        inner = optimizer.step

        def step(closure: Callable[[], Any] | None = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self.decide():
                self.apply(inner)
            self.conclude()
            return loss

        if hasattr(inner, "_wrapped_by_lr_sched"):  # torch's scheduler checks its own wrapper
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = step
        if scheduler is not None:  # a subclass, not an instance attribute: state_dict() is
            watch = self  # the instance's __dict__, and frameworks save it with torch.save

            cls = type(scheduler)
            unguarded = cls.step

            def sched_step(sched: Any, *args: Any, **kwargs: Any) -> Any:
                if watch.outcome in (APPLIED, REFUSED):
                    return unguarded(sched, *args, **kwargs)
                return None

            scheduler.__class__ = type(f"Gated{cls.__name__}", (cls,), {"step": sched_step})

    def _measure(self, step: int) -> StepState:
        """Clip (after measuring), then the step's one host transfer."""
        norm, factor, per_tensor = clip_by_global_norm(self.probes.params, self.cfg.grad_clip)
        if self._loss_share is not None:
            loss = self._loss_share
        elif self._loss_sum is not None:
            loss = self._loss_sum / self._loss_n
        else:
            raise RuntimeError(
                "spikewatch saw no loss this step: call observe_loss(loss) (or step(loss))"
            )
        xfer = HostTransfer()
        xfer.add([M.LOSS, M.GRAD_NORM, M.CLIP_FACTOR], torch.stack([loss, norm, factor]))
        attn = self.attn.take()
        if attn is not None:
            heads, layers, values = attn
            xfer.add(heads, values)
            xfer.add(layers, values.amax(dim=1))
        if self.probes.active(step):
            xfer.add(*self.probes.grad_norms(per_tensor))
        pending = self.probes.take_pending()
        if pending is not None:
            xfer.add(pending[1], pending[2], late=True)
        if self.same_step is not None:
            self.same_step.ride(xfer, loss, norm)
        metrics, late = xfer.fetch()  # the one device->host sync of the step
        refused_by = self.same_step.verdict(metrics) if self.same_step is not None else ""
        if pending is not None:
            self._emit_update_metrics(pending[0], late)
        metrics[M.LR] = float(self.optimizer.param_groups[0]["lr"]) * self.lr_scale
        self.metric_names.update(metrics)
        value, gnorm = metrics[M.LOSS], metrics[M.GRAD_NORM]
        return StepState(
            step=step,
            batch_index=self.index,
            loss=value,
            ce=value,
            grad_norm=gnorm,
            clip_factor=metrics[M.CLIP_FACTOR],
            lr=metrics[M.LR],
            tokens=0,
            nonfinite=not (math.isfinite(value) and math.isfinite(gnorm)),
            refused_by=refused_by,
            metrics=metrics,
        )

    def _emit_update_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metric_names.update(metrics)
        for cb in self.callbacks:
            cb.on_update_metrics(step, metrics)
        deliver_notes(self.callbacks)

    # -- checkpoints, rollback, resume ------------------------------------------------------
    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        (self.run_dir / "config.json").write_text(json.dumps(self.run_config(), indent=2))
        for cb in self.callbacks:
            cb.on_fit_start(self._fit_state())
        if self.checkpointer.enabled and self.checkpointer.latest() is None:
            self._save()  # the step-0 anchor: an early spike can roll back to it

    def _save_if_due(self) -> None:
        ck = self.checkpointer
        if ck.enabled and ck.last_saved != self.step_count:
            elapsed = time.perf_counter() - self._t0
            if ck.due(self.step_count, elapsed / max(self.step_count, 1)):
                self._save()
                return
        self.checkpointer.report(self.callbacks)  # an asynchronous save that landed meanwhile

    def persist(self) -> None:
        """Before a framework publishes its own checkpoint: the waiting update statistics go
        out and every record so far becomes durable, so a resume from that checkpoint, which
        re-sends only the steps after it, leaves each row in the store exactly once."""
        self._flush_probes()
        self.recorder.persist()

    def _flush_probes(self) -> None:
        pending = self.probes.take_pending_metrics()
        if pending is not None:
            self._emit_update_metrics(*pending)

    def _save(self) -> None:
        self._flush_probes()  # as the built-in loop: a resume never recomputes them
        self.checkpointer.save(self.step_count, self._snapshot)
        path = str(self.checkpointer.root / f"step{self.step_count:08d}")
        for cb in self.callbacks:
            cb.on_checkpoint(self.step_count, path, self.step_count in self.checkpointer.pins)
        self.checkpointer.report(self.callbacks)

    def _snapshot(self, stage: Stager | None) -> Snapshot:
        rng_tensors, rng_json = rng_states()
        torch_files = {
            **split_optimizer(to_host(self.optimizer.state_dict(), stage, "optimizer")),
            "model.pt": to_host(self.model.state_dict(), stage, "model"),
            "rng.pt": rng_tensors,
        }
        if self.scheduler is not None:
            torch_files["scheduler.pt"] = self.scheduler.state_dict()
        last = self.history[-1][1] if self.history else None
        return Snapshot(
            step=self.step_count,
            torch_files=torch_files,
            json_files={
                "trainer.json": {**self.state_dict(), "rng": rng_json},
                "config.json": self.run_config(),
            },
            meta={
                "run_id": self.run_id,
                "loss": last,
                "tokens": 0,
                "data_state": self.data.to_dict(),
                "generation": self.generation,
            },
        )

    def _pin_newest(self, reason: str) -> None:
        if self.checkpointer.enabled and self.checkpointer.last_saved is not None:
            self.checkpointer.pin(self.checkpointer.last_saved, reason)

    def _rollback(self, action: Rollback) -> None:
        """Restore the newest intact checkpoint at or before `to_step`, in-process; the data
        position goes on, so every batch after the restored step up to now is skipped, and
        the policy's ranges are skipped as they come."""
        step, path, abandoned = self.checkpointer.rollback_point(action.to_step)
        from_step = self.step_count
        self._restore(self.checkpointer.read(path, self.device), resume=False)
        self.checkpointer.pin(step, "rollback target")
        for start, end in action.skip_ranges:
            self.data.add_skip(start, end)
        self.lr_scale = rescale(self.lr_scale, action)
        record = self.interventions[-1]
        record.update(
            from_step=from_step,
            to_step=step,
            skip_ranges=[list(r) for r in action.skip_ranges],
            lr_scale=action.lr_scale,
            dropped_checkpoints=abandoned,
            resumed_at_batch=self.data.batch_index,
        )
        log.warning("rolled back from step %d to step %d (%s)", from_step, step, path.name)
        for cb in self.callbacks:
            cb.on_rollback(step, record)
        # The target again, as the next generation (which a resume prefers to the abandoned
        # newer steps), with what the run learned; only then are those deleted.
        self.generation += 1
        self._save()
        self.checkpointer.drop_after(step)
        self.checkpointer.report(self.callbacks)

    def _restore(self, loaded: dict[str, Any], *, resume: bool) -> None:
        state = loaded["trainer.json"]
        self.model.load_state_dict(loaded["model.pt"])
        self.optimizer.load_state_dict(join_optimizer(loaded))
        if self.scheduler is not None and "scheduler.pt" in loaded:
            self.scheduler.load_state_dict(loaded["scheduler.pt"])
        set_rng_states(loaded["rng.pt"], state["rng"])
        self.step_count = int(state["step"])
        if resume:
            self.load_state_dict(state)
        else:
            self._load_same_step(state)
        self.history = [(s, v) for s, v in self.history if s <= self.step_count]
        self.val_losses = [(s, v) for s, v in self.val_losses if s <= self.step_count]

    def _load_same_step(self, state: Mapping[str, Any]) -> None:
        if self.same_step is not None and state.get("same_step") is not None:
            self.same_step.load_state_dict(state["same_step"])

    def _resume(self) -> None:
        step, path = self.checkpointer.resume_point()
        self._restore(self.checkpointer.read(path, self.device), resume=True)
        log.info("resumed from %s", path)

    def state_dict(self) -> dict[str, Any]:
        """Everything but tensors: counters, data position, skips, callback (guard, recorder)
        states. Frameworks keep it in their own checkpoints, so their resume resumes it."""
        return {
            "run_id": self.run_id,
            "step": self.step_count,
            "data_state": self.data.to_dict(),
            "lr_scale": self.lr_scale,
            "generation": self.generation,
            "interventions": self.interventions,
            "val_losses": self.val_losses,
            "halted": self.halted,
            "same_step": None if self.same_step is None else self.same_step.state_dict(),
            "callbacks": {
                k: cb.state_dict()
                for k, cb in zip(callback_keys(self.callbacks), self.callbacks, strict=True)
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run_id = str(state["run_id"])
        self.step_count = int(state["step"])
        self.data = DataState.from_dict(state["data_state"])
        self.lr_scale = float(state["lr_scale"])
        self.generation = int(state.get("generation", 0))
        self.interventions = list(state["interventions"])
        self.val_losses = [(int(s), float(v)) for s, v in state["val_losses"]]
        self.halted = state.get("halted")
        self._load_same_step(state)
        saved = state["callbacks"]
        for key, cb in zip(callback_keys(self.callbacks), self.callbacks, strict=True):
            if key in saved:
                cb.load_state_dict(saved[key])

    def close(self, status: str | None = None) -> dict[str, Any]:
        """Flush the last update statistics, save the final state, close the run in the store;
        returns the summary (the built-in trainer's keys)."""
        if self._closed:
            return self.summary()
        self._closed = True
        self._start()
        self._flush_probes()
        try:
            if self.checkpointer.enabled and self.checkpointer.last_saved != self.step_count:
                self._save()
        finally:
            self.checkpointer.wait()
            self.checkpointer.report(self.callbacks)
            status = status or ("halted" if self.halted else "completed")
            for cb in self.callbacks:
                cb.on_fit_end(self._fit_state(status))
            self.sink.close(timeout=30)
        return self.summary()

    def write_summary(self, path: str | Path) -> None:
        """The summary as strict JSON (non-finite numbers as null)."""
        write_json(path, self.summary())

    def summary(self) -> dict[str, Any]:
        last = self.history[-1][1] if self.history else math.nan
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "framework": self.framework,
            "steps": self.step_count,
            "final_train_loss": last,
            "final_val_loss": self.val_losses[-1][1] if self.val_losses else math.nan,
            "val_losses": [{"step": s, "loss": v} for s, v in self.val_losses],
            "interventions": self.interventions,
            "halted": self.halted,
            "metric_names": sorted(self.metric_names),
            "config": self.run_config(),
            "verdicts": self.guard.verdicts,
        }

    def run_config(self) -> dict[str, Any]:
        """The run's config as the store and dashboard see it."""
        return {
            **self.cfg.to_dict(),
            "framework": self.framework,
            "model": self.model_info,
            "train": {"max_steps": self.cfg.max_steps},
        }

    def _fit_state(self, status: str = "running") -> FitState:
        return FitState(
            run_id=self.run_id,
            run_dir=str(self.run_dir),
            step=self.step_count,
            max_steps=self.cfg.max_steps or 0,
            config=self.run_config(),
            status=status,
        )
