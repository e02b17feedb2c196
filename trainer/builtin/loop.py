"""The built-in trainer: a client of the step core (trainer/core/step_core.py).

It brings what only it has: the deterministic sampler (any batch drawn again from its index, so
data rewinds on a rollback), injected faults, the GPT's forward/backward with its own LR
schedule, evaluation and the replay of a spike's batches. The core owns the step's measurement,
decision, rollback, checkpoints and resume. Under torchrun (trainer/core/world.py) each rank
trains its shard of the global batch; the core reduces the step's scalars and every rank carries
out rank 0's decision.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from spikewatch.trainer.builtin.data import Row, Sampler, build_sampler
from spikewatch.trainer.builtin.faults import FaultEffect, apply_faults, flip_bits
from spikewatch.trainer.builtin.schedule import lr_multiplier
from spikewatch.trainer.builtin.step import apply_update, forward_backward, forward_loss
from spikewatch.trainer.config import TrainConfig
from spikewatch.trainer.core.attribution import RowStat, preview, row_grad_norm
from spikewatch.trainer.core.callbacks import Callback
from spikewatch.trainer.core.guard import SpikeGuard
from spikewatch.trainer.core.lifecycle import check_resume, stop_on_signals
from spikewatch.trainer.core.probes import Probes
from spikewatch.trainer.core.setup import open_core
from spikewatch.trainer.core.state import RunState
from spikewatch.trainer.core.step_core import ROLLED_BACK, StepCore
from spikewatch.trainer.core.transfer import StepTensors
from spikewatch.trainer.core.world import init_world
from spikewatch.trainer.model.gpt import GPT, build_model
from spikewatch.trainer.model.optim import build_optimizer

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


class Trainer:
    """The built-in client; built by `build_trainer`, which does all the work of setting up."""

    def __init__(
        self, cfg: TrainConfig, core: StepCore, model: GPT, sampler: Sampler, device: torch.device
    ) -> None:
        self.cfg = cfg
        self.core = core
        self.model = model  # the GPT itself (the core may hold its DDP wrapper's view)
        self.sampler = sampler
        self.device = device
        self._seen: set[int] = set()  # batch indices trained on (for transient faults)
        self.optimizer, self.world = core.optimizer, core.world  # the core's, for short

    @property
    def step_count(self) -> int:
        """Updates on the live branch (the core's counter)."""
        return self.core.step_count

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> FitResult:
        cfg, core = self.cfg, self.core
        last = min(cfg.train.max_steps, cfg.train.stop_after or cfg.train.max_steps)
        t0, tokens0 = time.perf_counter(), core.run.tokens
        with stop_on_signals(core):
            try:
                core.start()
                while core.step_count < last and not core.stop_requested:
                    if self._train_step() == ROLLED_BACK:  # evaluated and saved: a restored step
                        continue
                    if self._eval_due(last):
                        self._evaluate()
                    core.save_if_due()
                    if core.step_count >= last and core.read_in_flight() == ROLLED_BACK:
                        continue  # read late: the last step's values rolled back; train on
                if core.stop_requested:
                    log.warning(
                        "stopping at step %d: %s", core.step_count, core.halted or "on request"
                    )
                    if not core.run.val_losses or core.run.val_losses[-1][0] != core.step_count:
                        self._evaluate()
                core.finish(core.status())
            finally:
                core.finish_pending()
        elapsed = time.perf_counter() - t0
        return self._result(elapsed, core.run.tokens - tokens0)

    def resume(self) -> int:
        """Continue from the newest intact checkpoint in the run directory; returns its step."""
        return _resume(self.core, self.cfg)

    def _compute(self, step: int, index: int, probing: bool) -> tuple[StepTensors, float, int]:
        """Forward and backward of batch `index` as step `step`: (tensors, LR multiplier,
        tokens). Nothing is applied yet."""
        cfg, world = self.cfg, self.world
        fault, _ = self._batch(index, step)
        self._seen.add(index)
        x = fault.x.to(self.device, non_blocking=True)
        y = fault.y.to(self.device, non_blocking=True)
        with self._computed_wrong(fault):
            t = self._forward_backward(step, x, y, probing, fault.nan_loss)
        lr_mult = lr_multiplier(cfg.schedule, step, cfg.train.max_steps) * self.core.run.lr_scale
        return t, lr_mult * fault.lr_factor, x.numel() * world.size

    def _forward_backward(
        self, step: int, x: torch.Tensor, y: torch.Tensor, probing: bool, nan: bool
    ) -> StepTensors:
        cfg, world = self.cfg, self.world
        return forward_backward(
            self.model if world.fwd is None else world.fwd,
            x,
            y,
            micro_batch=world.micro_batch(cfg.data),
            dtype=cfg.train.dtype,
            need_attn_max=cfg.optim.qk_clip_tau is not None
            or (probing and self.core.probes.wants_attn_max(step)),
            need_logit_stats=probing and self.core.probes.wants_logit_stats(step),
            grad_clip=cfg.optim.grad_clip,
            poison_nan=nan,
            clip=world.clip,
            no_sync=world.no_sync,
        )

    @contextlib.contextmanager
    def _computed_wrong(self, fault: FaultEffect) -> Iterator[None]:
        """An injected device fault: this rank's output logits computed wrong meanwhile."""
        if not fault.bit_flip:
            yield
            return
        hook = self.model.lm_head.register_forward_hook(lambda m, i, out: flip_bits(out))
        try:
            yield
        finally:
            hook.remove()

    def _batch(
        self, index: int, step: int, owner: int | None = None
    ) -> tuple[FaultEffect, list[Row]]:
        """This rank's rows (or rank `owner`'s, computed here) of batch `index` at `step`, as
        the faults leave them, with the rows a rollback left out refilled from the sampler's
        spares (fresh, unfaulted samples); and where each row comes from."""
        cfg, world = self.cfg, self.world
        owner = world.rank if owner is None else owner
        rows = world.rows(cfg.data.batch_size, owner)
        x, y = self.sampler.batch(index, step, rows)
        row0 = 0 if rows is None else rows.start
        first = index not in self._seen
        fault = apply_faults(
            cfg.faults, index, x, y, first, rank=owner, row0=row0, device_rank=world.rank
        )
        plan = self.sampler.plan(index, step)[row0 : row0 + x.size(0)]
        left_out = self.core.run.data.blocked_rows(index)
        mine = [(m, r - row0) for m, r in enumerate(left_out) if row0 <= r < row0 + x.size(0)]
        if mine:
            sx, sy, spare_plan = self.sampler.spares(index, step)
            fx, fy = fault.x.clone(), fault.y.clone()
            for m, r in mine:  # the m-th left-out row of the global batch takes spare row m
                fx[r], fy[r], plan[r] = sx[m], sy[m], spare_plan[m]
            fault = replace(fault, x=fx, y=fy)
        return fault, plan

    def measure_rows(self, index: int) -> list[RowStat]:
        """For the attribution of a spike (core/attribution.py): each of this rank's rows of
        batch `index`, its cross-entropy and gradient norm on the current weights, its id
        (corpus:offset) and its beginning."""
        cfg, world = self.cfg, self.world
        step = self.core.step_count + 1  # the mixture stage the batch would be drawn at
        fault, plan = self._batch(index, step)
        rows = world.rows(cfg.data.batch_size)
        row0 = 0 if rows is None else rows.start
        fwd = self.model if world.fwd is None else world.fwd
        out = []
        for r in range(fault.x.size(0)):
            x = fault.x[r : r + 1].to(self.device)
            y = fault.y[r : r + 1].to(self.device)
            with world.no_sync():  # this rank's row alone: no reduction over ranks
                ce = fwd(x, y).ce if world.strategy == "fsdp2" else _row_backward(fwd, x, y)
            grad = None if world.strategy == "fsdp2" else row_grad_norm(self.model.parameters())
            self.optimizer.zero_grad(set_to_none=True)
            name, start = plan[r]
            out.append(
                RowStat(
                    batch=index,
                    row=row0 + r,
                    loss=float(ce),
                    grad_norm=grad,
                    id=f"{name}:{start}",
                    preview=preview(fault.x[r].tolist()),
                )
            )
        return out

    def _train_step(self) -> str:
        """One step; returns what it came to (step_core's APPLIED, ..., ROLLED_BACK)."""
        core = self.core
        index = core.take_index()
        core.begin_step(index)
        step = core.step_count + 1
        t, lr_mult, ntok = self._compute(step, index, probing=True)
        gate = core.gate(t, lr=self.cfg.optim.lr * lr_mult, ntok=ntok)
        if gate.open:
            tau = self.cfg.optim.qk_clip_tau
            apply_update(self.model, self.optimizer, lr_mult, t.attn_max, tau, gate.factor)
        return core.conclude()

    def replay(self, step: int, index: int) -> tuple[StepTensors, Callable[[bool], None]]:
        """For the cause of a spike (the core's replay): batch `index` again, as step `step`
        (with the step's probes on, so that a compiled forward needs no graph of its own). Its
        LR comes from the step's number: a refused step has nothing else to advance."""
        t, lr_mult, _ = self._compute(step, index, probing=True)
        tau = self.cfg.optim.qk_clip_tau

        def end(applied: bool) -> None:
            if applied:
                apply_update(self.model, self.optimizer, lr_mult, t.attn_max, tau)

        return t, end

    def swap(self, step: int, index: int) -> torch.Tensor:
        """For the device check of a spike (core/cause.py): the next rank's rows of batch
        `index` as step `step`, computed here (forward only, the same micro-batches): the loss
        that rank would have computed, on this rank's device."""
        world = self.world
        fault, _ = self._batch(index, step, owner=(world.rank + 1) % world.size)
        try:
            with self._computed_wrong(fault):
                return forward_loss(
                    self.model,
                    fault.x.to(self.device),
                    fault.y.to(self.device),
                    micro_batch=world.micro_batch(self.cfg.data),
                    dtype=self.cfg.train.dtype,
                )
        finally:
            world.reshard(self.model)

    # -- evaluation -----------------------------------------------------------------------
    def _eval_due(self, last: int) -> bool:
        every = self.cfg.eval.interval
        return self.step_count == last or (every is not None and self.step_count % every == 0)

    @torch.no_grad()
    def _evaluate(self) -> float:
        cfg = self.cfg
        bs = cfg.eval.batch_size or cfg.data.micro_batch_size or cfg.data.batch_size
        self.model.eval()
        total = torch.zeros((), device=self.device)
        with self.core.paused():  # an evaluation is no stall
            for i in range(cfg.eval.batches):
                x, y = self.world.shard(*self.sampler.val_batch(i, bs))
                total += self.model(x.to(self.device), y.to(self.device)).ce
            val = self.world.mean(total / cfg.eval.batches).item()
        self.model.train()
        log.info("step %d: val loss %.4f", self.step_count, val)
        self.core.record_eval(val)
        return val

    # -- bookkeeping ----------------------------------------------------------------------
    def _result(self, elapsed: float, fit_tokens: int) -> FitResult:
        s = self.core.summary()
        extra = {k: v for cb in self.core.callbacks for k, v in cb.summary().items()}
        return FitResult(
            run_id=s["run_id"],
            run_dir=s["run_dir"],
            steps=s["steps"],
            final_train_loss=s["final_train_loss"],
            final_val_loss=s["final_val_loss"],
            tokens=s["tokens"],
            config=s["config"],
            interventions=s["interventions"],
            train_losses=[v for _, v in self.core.run.history],
            val_losses=list(self.core.run.val_losses),
            elapsed_s=elapsed,
            metric_names=s["metric_names"],
            halted=s["halted"],
            extra=extra,
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
    if cfg.train.compile:  # the training forward (DDP's too); the weights stay the model's
        world.fwd = cast(torch.nn.Module, torch.compile(model if world.fwd is None else world.fwd))
    optimizer = build_optimizer(model, cfg.optim)

    def resumed(core: StepCore) -> bool:
        if resume:
            _resume(core, cfg)
        return resume

    core = open_core(
        model=model,
        optimizer=optimizer,
        world=world,
        run=RunState(run_id=run_id, run_dir=path),
        probes=Probes(model, optimizer, cfg.probes, world),
        checkpoint=cfg.checkpoint,
        guard=cfg.guard,
        make_guard=lambda retained: SpikeGuard.for_config(cfg, retained),
        callbacks=callbacks,
        config=cfg.to_dict,
        data_flow="rewind",
        resume=resumed,
        resume_hint=f"--resume {path}",
        max_steps=cfg.train.max_steps,
    )
    trainer = Trainer(cfg, core, model, build_sampler(cfg.data, cfg.train.seed), device)
    core.replay, core.swap = trainer.replay, trainer.swap
    if cfg.guard.attribute_samples:
        core.measure_rows = trainer.measure_rows
        core.skip_samples = cfg.guard.skip_samples  # left-out rows are refilled (Trainer._batch)
    return trainer


def _row_backward(fwd: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = fwd(x, y)
    out.loss.backward()
    return out.ce.detach()


def _resume(core: StepCore, cfg: TrainConfig) -> int:
    """Continue from the newest intact checkpoint in the run directory; returns its step."""
    step = core.resume(lambda path: check_resume(cfg, path, core.world.size))
    for group in core.optimizer.param_groups:  # the optimizer state holds the old peak LR
        group["base_lr"] = cfg.optim.lr
    return step


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
