"""The loop: counters, callbacks, evaluation, stopping. The step's arithmetic is in step.py.

Per step: draw the next batch index from `DataState`, forward/backward, clip, one host transfer,
then ask the callbacks (`pre_update`) what to do before anything touches the weights. A
non-finite loss or gradient is always refused (SkipUpdate) and reported; callbacks may escalate.
"""

from __future__ import annotations

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

from trainer import metric_names as M
from trainer.actions import Action, Continue, Rollback, SkipUpdate, strongest
from trainer.callbacks import Callback, EvalState, FitState, StepState
from trainer.config import TrainConfig
from trainer.data import DataState, Sampler, build_sampler
from trainer.model import GPT, build_model
from trainer.optim import build_optimizer
from trainer.schedule import lr_multiplier
from trainer.step import StepTensors, apply_update, forward_backward

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

    def summary(self) -> dict[str, Any]:
        """The summary JSON (`spikewatch train --summary-json`)."""
        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "steps": self.steps,
            "final_train_loss": self.final_train_loss,
            "final_val_loss": self.final_val_loss,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / self.elapsed_s if self.elapsed_s > 0 else None,
            "elapsed_s": self.elapsed_s,
            "val_losses": [{"step": s, "loss": v} for s, v in self.val_losses],
            "interventions": self.interventions,
            "metric_names": self.metric_names,
            "config": self.config,
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


def _action_name(action: Action) -> str:
    return {Continue: "continue", SkipUpdate: "skip_update", Rollback: "rollback"}[type(action)]


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
        self.step = 0
        self.tokens = 0
        self.lr_scale = 1.0
        self.interventions: list[dict[str, Any]] = []
        self.train_losses: list[float] = []
        self.val_losses: list[tuple[int, float]] = []
        self.metric_names: set[str] = set()

    # -- the loop -------------------------------------------------------------------------
    def fit(self) -> FitResult:
        cfg = self.cfg
        last = min(cfg.train.max_steps, cfg.train.stop_after or cfg.train.max_steps)
        fit_state = self._fit_state()
        for cb in self.callbacks:
            cb.on_fit_start(fit_state)
        t0 = time.perf_counter()
        while self.step < last:
            self._train_step()
            if self._eval_due(last):
                self._evaluate()
        elapsed = time.perf_counter() - t0
        for cb in self.callbacks:
            cb.on_fit_end(self._fit_state())
        return self._result(elapsed)

    def _train_step(self) -> None:
        cfg, step = self.cfg, self.step + 1
        index = self.data_state.take()
        x, y = self.sampler.batch(index, step)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        tau = cfg.optim.qk_clip_tau
        t = forward_backward(
            self.model,
            x,
            y,
            micro_batch=cfg.data.micro_batch_size or cfg.data.batch_size,
            dtype=cfg.train.dtype,
            need_attn_max=tau is not None,
            grad_clip=cfg.optim.grad_clip,
        )
        lr_mult = lr_multiplier(cfg.schedule, step, cfg.train.max_steps) * self.lr_scale
        state = self._step_state(step, index, x.numel(), t, lr_mult)
        action = self._decide(state)
        if isinstance(action, Continue):
            apply_update(self.model, self.optimizer, lr_mult, t.attn_max, tau)
        self.optimizer.zero_grad(set_to_none=True)
        self.step, self.tokens = step, state.tokens
        self.train_losses.append(state.ce)
        done = replace(state, applied=isinstance(action, Continue), action=_action_name(action))
        for cb in self.callbacks:
            cb.post_step(done)
        if isinstance(action, Rollback):
            self._rollback(action)

    def _step_state(
        self, step: int, index: int, ntok: int, t: StepTensors, lr_mult: float
    ) -> StepState:
        tensors = t.scalars()
        if t.attn_max is not None:
            tensors.append(t.attn_max.flatten())
        host = torch.cat([v.float().reshape(-1) for v in tensors]).tolist()  # the one sync
        loss, ce, gnorm, clip = host[:4]
        metrics = {M.LOSS: loss, M.CE: ce, M.GRAD_NORM: gnorm, M.CLIP_FACTOR: clip}
        metrics[M.LR] = self.cfg.optim.lr * lr_mult
        rest = host[4:]
        if t.z_mean is not None:
            metrics[M.Z_MEAN], rest = rest[0], rest[1:]
        if t.attn_max is not None:
            nh = t.attn_max.size(1)
            for i, v in enumerate(rest):
                metrics[M.attn_max(i // nh, i % nh)] = v
        self.metric_names.update(metrics)
        return StepState(
            step=step,
            batch_index=index,
            loss=loss,
            ce=ce,
            grad_norm=gnorm,
            clip_factor=clip,
            lr=metrics[M.LR],
            tokens=self.tokens + ntok,
            nonfinite=not (math.isfinite(loss) and math.isfinite(gnorm)),
            metrics=metrics,
        )

    def _decide(self, state: StepState) -> Action:
        proposed: list[Action] = []
        if state.nonfinite:
            proposed.append(SkipUpdate(reason="non-finite loss or gradient"))
        proposed += [cb.pre_update(state) for cb in self.callbacks]
        action = strongest(proposed)
        if not isinstance(action, Continue):
            kind = _action_name(action)
            log.warning("step %d: %s (%s)", state.step, kind, action.reason)
            self.interventions.append(
                {
                    "step": state.step,
                    "batch_index": state.batch_index,
                    "kind": kind,
                    "reason": action.reason,
                    "loss": state.loss,
                    "grad_norm": state.grad_norm,
                }
            )
        return action

    def _rollback(self, action: Rollback) -> None:
        raise RuntimeError(
            f"a callback asked for Rollback(to_step={action.to_step}) but this trainer keeps no "
            "checkpoints to restore; rollback is carried out once checkpointing is configured"
        )

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
            x, y = self.sampler.val_batch(i, bs)
            total += self.model(x.to(self.device), y.to(self.device)).ce
        self.model.train()
        val = (total / cfg.eval.batches).item()
        self.val_losses.append((self.step, val))
        self.metric_names.add(M.VAL_LOSS)
        log.info("step %d: val loss %.4f", self.step, val)
        for cb in self.callbacks:
            cb.on_eval(EvalState(step=self.step, val_loss=val))
        return val

    # -- bookkeeping ----------------------------------------------------------------------
    def _fit_state(self) -> FitState:
        return FitState(
            run_id=self.run_id,
            run_dir=str(self.run_dir),
            step=self.step,
            max_steps=self.cfg.train.max_steps,
            config=self.cfg.to_dict(),
        )

    def _result(self, elapsed: float) -> FitResult:
        return FitResult(
            run_id=self.run_id,
            run_dir=str(self.run_dir),
            steps=self.step,
            final_train_loss=self.train_losses[-1] if self.train_losses else math.nan,
            final_val_loss=self.val_losses[-1][1] if self.val_losses else math.nan,
            tokens=self.tokens,
            config=self.cfg.to_dict(),
            interventions=list(self.interventions),
            train_losses=list(self.train_losses),
            val_losses=list(self.val_losses),
            elapsed_s=elapsed,
            metric_names=sorted(self.metric_names),
        )


def build_trainer(
    cfg: TrainConfig,
    *,
    run_dir: str | Path | None = None,
    callbacks: Sequence[Callback] = (),
) -> Trainer:
    """Seed, pick the device and threads, build model, optimizer and sampler, make the run dir."""
    device = resolve_device(cfg.train.device)
    if device.type == "cpu" and cfg.train.num_threads is not None:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)
    run_id = Path(run_dir).name if run_dir else new_run_id(cfg.name)
    path = Path(run_dir) if run_dir else Path("runs") / run_id
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    model = build_model(cfg.model, cfg.train.seed, device)
    return Trainer(
        cfg=cfg,
        model=model,
        optimizer=build_optimizer(model, cfg.optim),
        sampler=build_sampler(cfg.data, cfg.train.seed),
        data_state=DataState(),
        callbacks=callbacks,
        run_id=run_id,
        run_dir=path,
        device=device,
    )


def fit(
    cfg: TrainConfig, *, run_dir: str | Path | None = None, callbacks: Sequence[Callback] = ()
) -> FitResult:
    return build_trainer(cfg, run_dir=run_dir, callbacks=callbacks).fit()
