"""What the framework callbacks share: their options, the Watch they open, the run's summary.
Only wiring: the Watch (trainer/watch.py) owns everything else."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from spikewatch.observatory.strict_json import write_json
from spikewatch.trainer.watch import Watch

__all__ = ["Adapter"]


# The framework's own checkpoints carry the Watch's state (its resume resumes the guard), so the
# Watch's rollback targets need not survive the process: host memory by default, no disk files
# beside the framework's, every 25 steps ('auto': on a GPU, 5 to 25 as each snapshot's measured
# cost allows; trainer/checkpoints/memory.py). `checkpoint_every=N` (or settings'
# checkpoint.interval) adds disk.
ADAPTER_CHECKPOINTS = {"interval": None, "memory_interval": "auto"}


class Adapter:
    """Keywords go to `Watch` (db, name, settings, checkpoint_every, warmup_steps, ...);
    `run_root` holds the Watch's files (default: `spikewatch/` in the framework's output
    directory); `attn_max=False` leaves the model's attention alone. Rollback targets are
    kept in host memory (ADAPTER_CHECKPOINTS) unless settings say otherwise."""

    def __init__(
        self,
        *,
        run_root: str | Path | None = None,
        attn_max: bool = True,
        tags: Sequence[str] = (),
        **watch_kwargs: Any,
    ) -> None:
        if "resume" in watch_kwargs:
            raise ValueError(
                "the framework's own resume (resume_from_checkpoint, ckpt_path) resumes "
                "spikewatch with it: its checkpoints carry the Watch's state"
            )
        settings = watch_kwargs.get("settings")
        if not hasattr(settings, "to_dict"):  # a dict (or None): the adapters' default tiers
            settings = dict(settings or {})
            settings.setdefault("checkpoint", dict(ADAPTER_CHECKPOINTS))
            watch_kwargs["settings"] = settings
        self.run_root = run_root
        self.attn_max = attn_max
        self.tags = tags
        self.watch_kwargs = watch_kwargs
        self.watch: Watch | None = None
        self.summary: dict[str, Any] | None = None
        self._target = 0  # the framework's max_steps as asked for
        self._between = contextlib.ExitStack()  # a framework's evaluation or save under way

    def _slow_work_begins(self) -> None:
        """The framework evaluates or saves between two steps: the stall watchdog leaves it
        out (until `_slow_work_ends`), as the Watch's own checkpoints are."""
        if self.watch is not None and self.summary is None:
            self._between.close()
            self._between.enter_context(self.watch.paused())

    def _slow_work_ends(self) -> None:
        self._between.close()

    def _open(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        *,
        framework: str,
        output_dir: str | Path,
        default_name: str,
        max_steps: int | None,
        saved: Mapping[str, Any] | None,
        clip: float | None,
        **extra: Any,
    ) -> Watch:
        """The Watch around the framework's objects, their `step()` routed through it. `clip`:
        the framework's norm clipping, which the Watch takes over (after measuring)."""
        kwargs = {**extra, **self.watch_kwargs}
        if clip:
            kwargs.setdefault("grad_clip", float(clip))
        name = kwargs.pop("name", None) or default_name
        root = Path(self.run_root) if self.run_root else Path(output_dir) / "spikewatch"
        self.watch = Watch(
            model,
            optimizer,
            scheduler,
            name=name,
            run_dir=root / str(saved["run_id"]) if saved else None,
            run_root=root,  # a new run's id is agreed by every rank
            max_steps=max_steps,
            state=saved,
            tags=[*self.tags, framework],
            framework=framework,
            **kwargs,
        )
        self.watch.open()
        self.watch.route(optimizer, scheduler)
        return self.watch

    def _close(self) -> None:
        self._slow_work_ends()
        if self.watch is not None and self.summary is None:
            w = self.watch
            self.summary = w.close(
                "halted" if w.halted else "stopped" if w.stop_agreed else "completed"
            )

    def _eval(self, loss: float) -> None:
        """A validation loss: into the store while training, into the summary after it (the
        final evaluation, once the run is closed)."""
        if self.watch is None:
            return
        if self.summary is None:
            self.watch.log_eval(loss)
        else:
            self.summary["val_losses"].append({"step": self.watch.step_count, "loss": loss})
            self.summary["final_val_loss"] = loss

    def write_summary(self, path: str | Path) -> None:
        """The run's summary (once training has ended) as strict JSON; rank 0 writes it."""
        if self.summary is None:
            raise RuntimeError(f"{type(self).__name__}: no summary before training has ended")
        if self.watch is None or self.watch.world.is_main:  # rank 0 owns side effects
            write_json(path, self.summary)

    @property
    def _w(self) -> Watch:
        if self.watch is None:
            raise RuntimeError(f"{type(self).__name__}: training has not begun")
        return self.watch
