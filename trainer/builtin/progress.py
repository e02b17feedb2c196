"""A live progress bar (rich): step, loss, tokens/s, ETA, and any intervention as it happens."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from spikewatch.trainer.core.callbacks import Callback, EvalState, FitState, StepState

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    priority = -100  # after every callback that may change the step's outcome

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress: Progress | None = None
        self.task: Any = None
        self.val = float("nan")
        self._t = 0.0
        self._tps = 0.0
        self._tokens: int | None = None
        self.events: dict[str, int] = {}

    def on_fit_start(self, state: FitState) -> None:
        if state.val_loss is not None:  # a resumed run's last evaluation, until its next
            self.val = state.val_loss
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task(
            state.run_id, total=state.max_steps, completed=state.step, info=""
        )
        self.progress.start()
        self._t = time.perf_counter()

    def post_step(self, state: StepState) -> None:
        now = time.perf_counter()
        if self._tokens is not None:
            tps = (state.tokens - self._tokens) / max(now - self._t, 1e-9)
            self._tps = tps if self._tps == 0 else 0.9 * self._tps + 0.1 * tps
        self._t, self._tokens = now, state.tokens
        if state.action != "continue":
            self.events[state.action] = self.events.get(state.action, 0) + 1
            self.console.print(f"[yellow]step {state.step}: {state.action}[/] {state.reason}")
        info = f"loss {state.ce:.4f}  val {self.val:.4f}  {self._tps:,.0f} tok/s"
        if self.events:
            info += "  " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in self.events.items())
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=state.step, info=info)

    def on_eval(self, state: EvalState) -> None:
        self.val = state.val_loss

    def on_fit_end(self, state: FitState) -> None:
        if self.progress is not None:
            self.progress.stop()
