"""The loop: counters, callbacks, evaluation, stopping. The step's arithmetic is in step.py.

Per step: draw the next batch index from `DataState`, forward/backward, clip, one host transfer,
then ask the callbacks (`pre_update`) what to do before anything touches the weights. A
non-finite loss or gradient is always refused (SkipUpdate) and reported; callbacks may escalate.
Under torchrun (trainer/core/world.py) each rank trains its shard of the global batch, the
step's scalars are reduced before the transfer, and rank 0's decision is every rank's.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from observatory import metric_names as M
from trainer.builtin.data import DataState, Sampler, build_sampler
from trainer.builtin.faults import apply_faults
from trainer.builtin.schedule import lr_multiplier
from trainer.builtin.step import HostTransfer, StepTensors, apply_update, forward_backward
from trainer.checkpoints.disk import Checkpointer
from trainer.checkpoints.format import list_checkpoints as ck_list
from trainer.config import ConfigError, TrainConfig
from trainer.core.actions import Action, Continue, Halt, Rollback, Spike
from trainer.core.callbacks import Callback, EvalState, FitState, StepState
from trainer.core.decide import action_name, deliver_notes, intervention, propose, rescale
from trainer.core.guard import SpikeGuard
from trainer.core.lifecycle import check_resume, stop_on_signals
from trainer.core.probes import Probes
from trainer.core.recorder import Recorder
from trainer.core.same_step import SameStepGate
from trainer.core.state import build_snapshot, restore
from trainer.core.world import World, init_world
from trainer.model.gpt import GPT, build_model
from trainer.model.optim import build_optimizer

__all__ = ["FitResult", "Trainer", "build_trainer", "fit"]


log = logging.getLogger(__name__)


@dataclass
class FitResult:
    run_id: str
    run_dir: str
    steps: int
    final_train_loss: float
    final_val_loss: float
    tokens: int
    config: dict[str, Any]
    interventions: list[dict[str, Any]] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)  # ce per step, in step order
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    elapsed_s: float = 0.0
    metric_names: list[str] = field(default_factory=list)
    halted: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # from the callbacks' summary()
    fit_tokens: int = 0  # tokens trained by this fit() call (a resumed run's are fewer)

    def summary(self) -> dict[str, Any]:
        """The summary JSON (`spikewatch train --summary-json`)."""
        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "steps": self.steps,
            "final_train_loss": self.final_train_loss,
            "final_val_loss": self.final_val_loss,
            "tokens": self.tokens,
            "tokens_per_s": (
                self.fit_tokens / self.elapsed_s if self.fit_tokens and self.elapsed_s > 0 else None
            ),
            "elapsed_s": self.elapsed_s,
            "val_losses": [{"step": s, "loss": v} for s, v in self.val_losses],
            "interventions": self.interventions,
            "halted": self.halted,
            "metric_names": self.metric_names,
            "config": self.config,
            **self.extra,
        }


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but no CUDA device is available")
    return torch.device(name)


def new_run_id(name: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{os.urandom(2).hex()}"  # os.urandom: leaves every seeded RNG alone


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


_STOP = "_stop"  # rides the step's transfer under torchrun; never a metric


@functools.lru_cache(maxsize=16)  # a function of the shape only: no Trainer kept alive
def _attn_names(n_layer: int, n_head: int) -> tuple[list[str], list[str]]:
    """Per-head and per-layer max-logit names, built once rather than every step."""
    heads = [M.attn_max(i, h) for i in range(n_layer) for h in range(n_head)]
    return heads, [M.layer_attn_max(i) for i in range(n_layer)]


class Trainer:
    """Holds what `fit` needs; built by `build_trainer`, which does all the work of setting up."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: GPT,
        optimizer: torch.optim.Optimizer,
        sampler: Sampler,
        data_state: DataState,
        callbacks: Sequence[Callback],
        run_id: str,
        run_dir: Path,
        device: torch.device,
        checkpointer: Checkpointer,
        probes: Probes,
        world: World | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.data_state = data_state
        self.callbacks = sorted(callbacks, key=lambda c: -c.priority)
        self.run_id = run_id
        self.run_dir = run_dir
        self.device = device
        self.checkpointer = checkpointer
        self.probes = probes
        self.world = world or World()
        self.stop_asked = False  # a signal arrived (under torchrun: not yet agreed on)
        self._last_step_end: float | None = None
        self.step = 0
        self.tokens = 0
        self.lr_scale = 1.0
        self.interventions: list[dict[str, Any]] = []
        self.history: list[tuple[int, float]] = []  # (step, ce) of the live branch
        self.stop_requested = False
        self.halted: str | None = None
        self._seen: set[int] = set()  # batch indices trained on (for transient faults)
        self.seconds_per_step = 0.0
        self.val_losses: list[tuple[int, float]] = []
        self.metric_names: set[str] = set()
        self.resumed_loss = math.nan  # the loss of the step a resume started from
        self.generation = 0  # rollbacks carried out: checkpoints of a newer one supersede
        self.config_changes: dict[str, list[Any]] = {}  # what this resume changed, for the record
        tier = cfg.watch.same_step
        self.same_step = SameStepGate(tier, device) if cfg.watch.enabled and tier.enabled else None

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> FitResult:
        cfg = self.cfg
        last = min(cfg.train.max_steps, cfg.train.stop_after or cfg.train.max_steps)
        for cb in self.callbacks:
            cb.on_fit_start(self._fit_state())
        if self.config_changes:
            for cb in self.callbacks:
                cb.on_config_change(self.step, self.config_changes)
            self.config_changes = {}
        t0, steps_done, tokens0 = time.perf_counter(), 0, self.tokens
        with stop_on_signals(self):
            try:
                if self.checkpointer.enabled and self.checkpointer.latest() is None:
                    self._save()  # the step-0 anchor: an early spike can roll back to it
                self._last_step_end = time.perf_counter()  # the first step is timed too
                while self.step < last and not self.stop_requested:
                    rolled_back = self._train_step()
                    steps_done += 1
                    self.seconds_per_step = (time.perf_counter() - t0) / steps_done
                    if rolled_back:  # evaluated and saved already: this step is a restored one
                        continue
                    if self._eval_due(last):
                        self._evaluate()
                    if self.checkpointer.due(self.step, self.seconds_per_step):
                        self._save()
                    else:
                        self.checkpointer.report(self.callbacks)  # an asynchronous save that landed
                if self.stop_requested:
                    log.warning("stopping at step %d: %s", self.step, self.halted or "on request")
                    if not self.val_losses or self.val_losses[-1][0] != self.step:
                        self._evaluate()
                if self.checkpointer.enabled and self.checkpointer.last_saved != self.step:
                    self._save()
            finally:
                self._flush_probes()
                self.checkpointer.wait()
                self.checkpointer.report(self.callbacks)
        elapsed = time.perf_counter() - t0
        status = "halted" if self.halted else "stopped" if self.stop_requested else "completed"
        for cb in self.callbacks:
            cb.on_fit_end(self._fit_state(status))
        return self._result(elapsed, self.tokens - tokens0)

    def _save(self) -> None:
        # The step's update statistics go out now, not with the next step's transfer: a resume
        # from this checkpoint never recomputes them. The checkpointer commits only once every
        # record logged so far is durable (`Recorder.persist`).
        self._flush_probes()
        stall = self.checkpointer.save(self.step, lambda stage: build_snapshot(self, stage))
        log.debug("checkpoint at step %d (loop blocked %.3fs)", self.step, stall)
        path = str(self.checkpointer.root / f"step{self.step:08d}")
        for cb in self.callbacks:
            cb.on_checkpoint(self.step, path, self.step in self.checkpointer.pins)
        self.checkpointer.report(self.callbacks)

    def resume(self) -> int:
        """Continue from the newest intact checkpoint in the run directory; returns its step."""
        step, path = self.checkpointer.resume_point()
        changes = check_resume(self.cfg, path, self.world.size)
        restore(self, self.checkpointer.read(path, self.device), resume=True)
        for group in self.optimizer.param_groups:  # the optimizer state holds the old peak LR
            group["base_lr"] = self.cfg.optim.lr
        if changes:
            shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
            log.warning("resumed from %s with changed settings: %s", path, shown)
        else:
            log.info("resumed from %s", path)
        self.config_changes = changes
        return step

    def _compute(self, step: int, index: int, probing: bool) -> tuple[StepTensors, float, int]:
        """Forward and backward of batch `index` as step `step`: (tensors, LR multiplier,
        tokens). Nothing is applied yet."""
        cfg, world = self.cfg, self.world
        x, y = self.sampler.batch(index, step, world.rows(cfg.data.batch_size))
        first = index not in self._seen
        fault = apply_faults(cfg.faults, index, x, y, first_time=first, rank=world.rank)
        self._seen.add(index)
        x = fault.x.to(self.device, non_blocking=True)
        y = fault.y.to(self.device, non_blocking=True)
        t = forward_backward(
            world.fwd or self.model,
            x,
            y,
            micro_batch=world.micro_batch(cfg.data),
            dtype=cfg.train.dtype,
            need_attn_max=cfg.optim.qk_clip_tau is not None
            or (probing and self.probes.wants_attn_max(step)),
            need_logit_stats=probing and self.probes.wants_logit_stats(step),
            grad_clip=cfg.optim.grad_clip,
            poison_nan=fault.nan_loss,
            clip=world.clip,
            no_sync=world.no_sync,
        )
        t = world.reduce(t, stop=self.stop_asked)
        lr_mult = lr_multiplier(cfg.schedule, step, cfg.train.max_steps) * self.lr_scale
        return t, lr_mult * fault.lr_factor, x.numel() * world.size

    def _train_step(self) -> bool:
        """One step; True when it ended in a rollback (the run continues from a restored one)."""
        step = self.step + 1
        index = self.data_state.take()
        tau = self.cfg.optim.qk_clip_tau
        t, lr_mult, ntok = self._compute(step, index, probing=True)
        state, late = self._step_state(step, index, ntok, t, lr_mult)
        if late is not None:
            self._emit_update_metrics(*late)
        action = self._decide(state)
        applied = isinstance(action, Continue)
        if applied:
            self.checkpointer.before_mutation()  # an async save may still be copying weights
            self.probes.before_update(step)
            apply_update(self.model, self.optimizer, lr_mult, t.attn_max, tau)
        self.probes.after_update(step, applied)
        self.optimizer.zero_grad(set_to_none=True)
        self.step, self.tokens = step, state.tokens
        self.history.append((step, state.ce))
        reason = "" if isinstance(action, Continue) else action.reason
        done = replace(state, applied=applied, action=action_name(action), reason=reason)
        for cb in self.callbacks:
            cb.post_step(done)
        if isinstance(action, Rollback):
            self._rollback(action)
            return True
        return False

    def _step_state(
        self, step: int, index: int, ntok: int, t: StepTensors, lr_mult: float
    ) -> tuple[StepState, tuple[int, dict[str, float]] | None]:
        """The step's one host transfer: its own metrics plus the previous step's update
        statistics, which only existed after that step's optimizer update."""
        xfer = HostTransfer()
        xfer.add(
            [M.LOSS, M.CE, M.GRAD_NORM, M.CLIP_FACTOR],
            torch.stack([t.loss, t.ce, t.grad_norm, t.clip_factor]),
        )
        if t.z_mean is not None:
            xfer.add([M.Z_MEAN], t.z_mean)
        if t.logit_max is not None:
            xfer.add([M.LOGIT_MAX], t.logit_max)
        if t.attn_max is not None:
            heads, layers = _attn_names(*t.attn_max.shape)
            xfer.add(heads, t.attn_max)
            xfer.add(layers, t.attn_max.amax(dim=1))
        if self.probes.active(step):
            xfer.add(*self.probes.grad_norms(t.grad_norms))
        pending = self.probes.take_pending()
        if pending is not None:
            xfer.add(pending[1], pending[2], late=True)
        if t.stop is not None:
            xfer.add([_STOP], t.stop)
        if self.same_step is not None:
            self.same_step.ride(xfer, t.loss, t.grad_norm)
        metrics, late_metrics = xfer.fetch()  # the one device->host sync of the step
        if metrics.pop(_STOP, 0.0) > 0:  # a rank was signalled: all stop after this step
            self.stop_requested = True
        refused_by = self.same_step.verdict(metrics) if self.same_step is not None else ""
        metrics[M.LR] = self.cfg.optim.lr * lr_mult
        now = time.perf_counter()
        if self._last_step_end is not None:
            metrics[M.TOKENS_PER_S] = ntok / max(now - self._last_step_end, 1e-9)
        self._last_step_end = now
        self.metric_names.update(metrics)
        loss, gnorm = metrics[M.LOSS], metrics[M.GRAD_NORM]
        state = StepState(
            step=step,
            batch_index=index,
            loss=loss,
            ce=metrics[M.CE],
            grad_norm=gnorm,
            clip_factor=metrics[M.CLIP_FACTOR],
            lr=metrics[M.LR],
            tokens=self.tokens + ntok,
            nonfinite=not (math.isfinite(loss) and math.isfinite(gnorm)),
            refused_by=refused_by,
            metrics=metrics,
        )
        return state, (None if pending is None else (pending[0], late_metrics))

    def _emit_update_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metric_names.update(metrics)
        for cb in self.callbacks:
            cb.on_update_metrics(step, metrics)
        deliver_notes(self.callbacks)

    def _flush_probes(self) -> None:
        pending = self.probes.take_pending_metrics()
        if pending is not None:
            self._emit_update_metrics(*pending)

    def _propose(self, state: StepState) -> Action:
        action, pins = propose(state, self.callbacks)
        deliver_notes(self.callbacks)  # the verdicts that led to it, recorded before the step
        for reason in pins:
            self._pin_newest(reason)
        return action

    def _decide(self, state: StepState) -> Action:
        """Rank 0's callbacks decide; every rank carries out that one action (broadcast)."""
        action = self.world.agree(self._propose(state) if self.world.is_main else None)
        if isinstance(action, Continue):
            self.lr_scale = rescale(self.lr_scale, action)  # from the next step on
        else:
            log.warning("step %d: %s (%s)", state.step, action_name(action), action.reason)
            self.interventions.append(intervention(action, state))
            if isinstance(action, Halt):
                self.stop_requested = True
                self.halted = action.reason
        return action

    def request_stop(self) -> None:
        """From a signal handler: stop after this step. Under torchrun the request rides the
        next step's all-reduce first, so that every rank stops after the same step."""
        self.stop_asked = True
        if not self.world.distributed:
            self.stop_requested = True

    def _pin_newest(self, reason: str) -> None:
        if self.checkpointer.enabled and self.checkpointer.last_saved is not None:
            self.checkpointer.pin(self.checkpointer.last_saved, reason)

    def _rollback(self, action: Rollback) -> None:
        """Restore the newest intact checkpoint at or before `to_step`, in-process, then skip."""
        step, path, abandoned = self.checkpointer.rollback_point(action.to_step)
        from_step = self.step
        restore(self, self.checkpointer.read(path, self.device), resume=False)
        record = self.interventions[-1]
        if action.spike is not None and action.spike.replay:
            record.update(self._classify(action.spike, step))
            restore(self, self.checkpointer.read(path, self.device), resume=False)
        self.checkpointer.pin(step, "rollback target")
        for start, end in action.skip_ranges:
            self.data_state.add_skip(start, end)
        self.lr_scale = rescale(self.lr_scale, action)
        record.update(
            from_step=from_step,
            to_step=step,
            skip_ranges=[list(r) for r in action.skip_ranges],
            lr_scale=action.lr_scale,
            dropped_checkpoints=abandoned,
        )
        log.warning("rolled back from step %d to step %d (%s)", from_step, step, path.name)
        for cb in self.callbacks:
            cb.on_rollback(step, record)
        # Rewrite the restored step's checkpoint with what the run learned (skip ranges, LR
        # scale, policy and detector states) as the next generation, which a resume prefers to
        # the abandoned newer steps; only then delete those. A crash at any moment must not
        # train the bad batches again.
        self.generation += 1
        self._save()
        self.checkpointer.drop_after(step)
        self.checkpointer.report(self.callbacks)

    def _classify(self, spike: Spike, from_step: int) -> dict[str, Any]:
        """Replay the spike's steps once from the restored state, on the same batches: a spike
        that comes back needs this data with this state (PaLM); one that does not was
        transient (a flaky update, possibly a hardware fault: Megatron's question). Returns
        the record's `cause` and `replay_peak_loss`."""
        losses = {}
        for step, index in spike.replay:
            if step <= from_step:
                continue
            t, lr_mult, _ = self._compute(step, index, probing=False)
            loss, gnorm = torch.stack([t.loss, t.grad_norm]).tolist()  # rare path: one sync
            if math.isfinite(loss) and math.isfinite(gnorm):  # as the loop: never apply these
                tau = self.cfg.optim.qk_clip_tau
                apply_update(self.model, self.optimizer, lr_mult, t.attn_max, tau)
            self.optimizer.zero_grad(set_to_none=True)
            losses[step] = loss if math.isfinite(loss) else math.inf
        level, peak = spike.pre_spike_loss, spike.peak_loss
        after = [v for s, v in losses.items() if s >= spike.onset_step]
        replay_peak = max(after, default=math.nan)
        if level is None or peak is None or not after:
            cause = "unknown"
        elif not math.isfinite(peak):  # a non-finite spike reproduces only as non-finite
            cause = "data_x_state" if math.isinf(replay_peak) else "transient"
        elif math.isinf(replay_peak) or replay_peak >= level + 0.5 * (peak - level):
            cause = "data_x_state"  # it reproduces
        else:
            cause = "transient"
        log.warning(
            "replayed steps %d..%d: the spike %s (peak %.4f, originally %.4f)",
            from_step + 1,
            max(losses, default=from_step),
            "reproduces" if cause == "data_x_state" else "does not reproduce",
            replay_peak,
            peak if peak is not None else math.nan,
        )
        return {"cause": cause, "replay_peak_loss": replay_peak}

    # -- evaluation -----------------------------------------------------------------------
    def _eval_due(self, last: int) -> bool:
        every = self.cfg.eval.interval
        return self.step == last or (every is not None and self.step % every == 0)

    @torch.no_grad()
    def _evaluate(self) -> float:
        cfg = self.cfg
        bs = cfg.eval.batch_size or cfg.data.micro_batch_size or cfg.data.batch_size
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for i in range(cfg.eval.batches):
            x, y = self.world.shard(*self.sampler.val_batch(i, bs))
            total += self.model(x.to(self.device), y.to(self.device)).ce
        self.model.train()
        val = self.world.mean(total / cfg.eval.batches).item()
        self.val_losses.append((self.step, val))
        self.metric_names.add(M.VAL_LOSS)
        log.info("step %d: val loss %.4f", self.step, val)
        for cb in self.callbacks:
            cb.on_eval(EvalState(step=self.step, val_loss=val))
        return val

    # -- bookkeeping ----------------------------------------------------------------------
    def _fit_state(self, status: str = "running") -> FitState:
        return FitState(
            run_id=self.run_id,
            run_dir=str(self.run_dir),
            step=self.step,
            max_steps=self.cfg.train.max_steps,
            config=self.cfg.to_dict(),
            status=status,
        )

    def _result(self, elapsed: float, fit_tokens: int) -> FitResult:
        return FitResult(
            run_id=self.run_id,
            run_dir=str(self.run_dir),
            steps=self.step,
            final_train_loss=self.history[-1][1] if self.history else self.resumed_loss,
            final_val_loss=self.val_losses[-1][1] if self.val_losses else math.nan,
            tokens=self.tokens,
            config=self.cfg.to_dict(),
            interventions=list(self.interventions),
            train_losses=[v for _, v in self.history],
            val_losses=list(self.val_losses),
            elapsed_s=elapsed,
            metric_names=sorted(self.metric_names),
            halted=self.halted,
            extra={k: v for cb in self.callbacks for k, v in cb.summary().items()},
            fit_tokens=fit_tokens,
        )


def build_trainer(
    cfg: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    callbacks: Sequence[Callback] = (),
    resume: bool = False,
) -> Trainer:
    """Seed, pick the device and threads, build model, optimizer and sampler, make the run dir;
    with `resume`, load the newest intact checkpoint of `run_dir`."""
    world, device = init_world(cfg, resolve_device(cfg.train.device))
    if device.type == "cpu" and cfg.train.num_threads is not None:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)
    if resume and run_dir is None:
        raise ValueError("resume needs the run directory")
    run_id = Path(run_dir).name if run_dir else world.agree(new_run_id(cfg.name))
    path = Path(run_dir) if run_dir else Path("runs") / run_id
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg.model, cfg.train.seed, device)
    world.wrap(model, device)  # before the optimizer: fsdp2 swaps in sharded parameters
    optimizer = build_optimizer(model, cfg.optim)
    recorder = next((c for c in callbacks if isinstance(c, Recorder)), None)
    durable = None if recorder is None else recorder.persist  # the record, before each commit
    checkpointer = Checkpointer(path / "checkpoints", cfg.checkpoint, before_commit=durable)
    if world.distributed:
        from trainer.checkpoints.sharded import ShardedCheckpointer

        checkpointer = ShardedCheckpointer(
            path / "checkpoints", cfg.checkpoint, world, model, optimizer, before_commit=durable
        )
    checkpointer.open()
    if cfg.watch.enabled and world.is_main:  # rank 0 decides for all
        callbacks = [*callbacks, SpikeGuard.for_config(cfg, checkpointer.retained)]
    trainer = Trainer(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        sampler=build_sampler(cfg.data, cfg.train.seed),
        data_state=DataState(),
        callbacks=callbacks,
        run_id=run_id,
        run_dir=path,
        device=device,
        checkpointer=checkpointer,
        probes=Probes(model, optimizer, cfg.probes, world),
        world=world,
    )
    if resume:
        trainer.resume()
    elif ck_list(checkpointer.root):
        raise ConfigError(
            f"{path} already holds checkpoints of a run: resume it (--resume {path}) or choose "
            "another run directory"
        )
    if world.is_main:
        (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    return trainer


def fit(
    cfg: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    callbacks: Sequence[Callback] = (),
    resume: bool = False,
) -> FitResult:
    trainer = build_trainer(cfg, run_dir=run_dir, callbacks=callbacks, resume=resume)
    try:
        return trainer.fit()
    finally:
        trainer.world.close()  # the process group, if build_trainer created it
