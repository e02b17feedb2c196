"""torchtitan's own DCP checkpoints as the Watch's disk tier: rollback targets older than host
memory holds, kept on spikewatch's exponential schedule with the pre-spike ones pinned.

Two pieces, because torchtitan's loop owns when it saves and spikewatch owns what is kept:
- `TitanCheckpointManager`, torchtitan's `CheckpointManager` with spikewatch's retention in
  place of keep-latest-k (the newest `keep_latest_k`, then one per power-of-two age bucket,
  observatory/retention.py, plus every pinned step), and a hook before each of its saves (the
  Watch reads the step in flight first: a checkpoint holds only decided steps);
- `TitanDisk`, the disk tier as trainer/checkpoints/tiers.py sees it: the steps held
  (`step-N` folders with DCP's `.metadata`), pins (in `spikewatch-pins.json` beside them, so
  they survive a restart), a rollback's in-place load (model, optimizer, LR schedule and the
  Watch's state; never the data loader, which flows on past the offending batches), the
  rewrite of the restored step after a rollback, and the deletion of the abandoned branch.

The rewrite is what makes a crash after a rollback safe: the restored step's checkpoint is
written again with what the run learned (the skips, the loader's position after them, the
guard's state) into a temporary folder, and only then swapped in; the newer checkpoints of the
abandoned branch are deleted after it, so a resume never trains the offending batches again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.checkpoint import DATALOADER, AsyncMode, CheckpointManager

from spikewatch.observatory.retention import keep
from spikewatch.trainer.checkpoints.errors import CheckpointError
from spikewatch.trainer.config import CheckpointConfig
from spikewatch.trainer.core.world import World

__all__ = ["PINS", "TitanCheckpointManager", "TitanDisk"]

log = logging.getLogger(__name__)

PINS = "spikewatch-pins.json"  # {step: [reasons]}, rank 0's, beside the step folders
_STEP = re.compile(r"^step-(\d+)$")
KEEP_ALL = 10**6  # keep_latest_k = 0: torchtitan keeps every checkpoint, and so do we


class TitanCheckpointManager(CheckpointManager):
    """torchtitan's DCP checkpointer with spikewatch's retention. `disk` (set by the trainer
    once the Watch opens) decides what is kept and hears of each save."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    disk: TitanDisk | None = None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        disk = self.disk
        if disk is not None and self._should_save(curr_step, last_step):
            if not disk.before_save(curr_step):
                return False
        saved = super()._save(curr_step, last_step)
        if saved and disk is not None:
            disk.landed(curr_step)
        return saved

    def _purge_stale_checkpoints(self) -> None:
        if self.disk is None:
            super()._purge_stale_checkpoints()
        elif self.keep_latest_k > 0:
            self.disk.prune()


class TitanDisk:
    """The disk tier of trainer/checkpoints/tiers.py over torchtitan's checkpoints."""

    def __init__(
        self,
        manager: TitanCheckpointManager,
        world: World,
        *,
        train_state: Any,
        before_save: Callable[[int], bool],
    ) -> None:
        """`train_state`: torchtitan's trainer (its `step`, `ntokens_seen`, and the Watch's
        state its `state_dict` carries); `before_save(step)`: False skips torchtitan's save of
        `step` (a rollback moved the run, or just wrote it)."""
        self.manager, self.world, self.train_state = manager, world, train_state
        self._before_save = before_save
        self.root = Path(manager.folder)
        k = manager.keep_latest_k
        self.cfg = CheckpointConfig(interval=manager.interval, keep_last=k or KEEP_ALL)
        self.pins: dict[int, set[str]] = {}
        self.last_saved: int | None = None
        self.save_seconds: float | None = None
        self._changes: list[tuple[int, str, str]] = []
        self._rewritten: int | None = None  # the step a rollback just wrote again

    # -- what the tiers ask -----------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self.manager.enable) and not self.manager.load_only

    @property
    def in_background(self) -> bool:
        return self.manager.async_mode != AsyncMode.DISABLED

    @property
    def awaits(self) -> bool:
        return False  # torchtitan saves its own steps; the core's saves here are rewrites

    def complete(self, step: int, trainer: dict[str, Any], meta: dict[str, Any]) -> None:
        """Never awaiting (`awaits` is False): nothing to complete."""

    def drop(self, step: int) -> None:
        """Never awaiting (`awaits` is False): nothing to drop."""

    def open(self) -> None:
        """Pins from the last job, and the newest checkpoint held."""
        if self.world.is_main:
            for name in [p.name for p in self.root.glob(".spikewatch-*")]:
                shutil.rmtree(self.root / name, ignore_errors=True)  # a killed rewrite's
        self.world.barrier()
        pins = self.root / PINS
        if pins.exists():
            saved = json.loads(pins.read_text())
            self.pins = {int(s): set(r) for s, r in saved.items()}
        held = self.retained()
        self.last_saved = held[-1] if held else None

    def due(self, step: int, seconds_per_step: float) -> bool:
        return False  # torchtitan's loop saves on its own interval (`--checkpoint.interval`)

    def path_of(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def has(self, step: int) -> bool:
        return (self.path_of(step) / ".metadata").is_file()

    def retained(self) -> list[int]:
        """Steps of the complete checkpoints (a save in flight has no `.metadata` yet)."""
        if not self.root.is_dir():
            return []
        steps = [int(m.group(1)) for p in self.root.iterdir() if (m := _STEP.match(p.name))]
        return sorted(s for s in steps if self.has(s))

    def latest(
        self, at_most: int | None = None, above: int | None = None
    ) -> tuple[int, Path] | None:
        self.wait()
        held = [
            s
            for s in self.retained()
            if (at_most is None or s <= at_most) and (above is None or s > above)
        ]
        return (held[-1], self.path_of(held[-1])) if held else None

    def resume_point(self) -> tuple[int, Path]:
        raise CheckpointError("torchtitan resumes its own checkpoints (the trainer's load)")

    def before_mutation(self) -> float:
        return 0.0  # torchtitan waits for its own staging before the update

    def wait(self) -> None:
        self.manager.maybe_wait_for_saving()

    def take_changes(self) -> list[tuple[int, str, str]]:
        out, self._changes = self._changes, []
        return out

    # -- torchtitan's own saves ------------------------------------------------------------
    def before_save(self, step: int) -> bool:
        if step == self._rewritten:  # a rollback wrote this step a moment ago
            return False
        return self._before_save(step)

    def landed(self, step: int) -> None:
        self._rewritten = None
        self.last_saved = step
        self._changes.append((step, str(self.path_of(step)), "ok"))

    def prune(self) -> None:
        """Rank 0, after each save: the newest `keep_latest_k`, one per power-of-two age bucket,
        the pinned ones; the rest go (on torchtitan's purge thread where it has one)."""
        if not self.world.is_main or not self.root.is_dir():
            return
        steps = [int(m.group(1)) for p in self.root.iterdir() if (m := _STEP.match(p.name))]
        if not steps:
            return
        now = max(steps)  # the save in flight counts: it is the newest
        kept = keep(steps, now, pins=self.pins, keep_last=self.cfg.keep_last)
        for step in sorted(set(steps) - kept):
            self._delete(step)

    def _delete(self, step: int) -> None:
        path = self.path_of(step)
        (path / ".metadata").unlink(missing_ok=True)  # never mistaken for a checkpoint again
        queue = getattr(self.manager, "purge_queue", None)
        if queue is not None and self.manager.purge_thread is not None:
            queue.put(str(path))
        else:
            shutil.rmtree(path, ignore_errors=True)
        self._changes.append((step, str(path), "deleted"))

    # -- the core's explicit saves: a rollback's rewrite ----------------------------------
    def prepare(self, build: Callable[[Any], Any]) -> None:
        """Nothing to make ahead: torchtitan's checkpointer stages its own saves."""

    @property
    def takes_lent(self) -> bool:
        return False  # torchtitan's checkpointer writes the live state its own way

    def save(
        self, step: int, build: Callable[[Any], Any], awaiting: bool = False, lent: Any = None
    ) -> float | None:
        """Write `step` again (after a rollback restored it): into a temporary folder, then in
        place of the old one. Step 0 is not written (torchtitan loads a step-0 checkpoint as
        the model alone; host memory holds the step-0 anchor). Returns the stall, or None."""
        if lent is not None:
            raise ValueError("torchtitan's checkpoints write the live state: nothing is lent")
        if awaiting:
            raise ValueError("torchtitan's checkpoints cannot take a step still in flight")
        if step == 0:
            return None
        t0 = time.perf_counter()
        manager, world = self.manager, self.world
        self.wait()
        self.train_state.step = step
        final, tmp = self.path_of(step), self.root / f".spikewatch-{step}.tmp"
        old = self.root / f".spikewatch-{step}.old"
        if world.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        world.barrier()
        states = manager._flattened_model_states_sd()
        manager.dcp_save(states, checkpoint_id=str(tmp), async_mode=AsyncMode.DISABLED)
        world.barrier()
        if world.is_main:
            if final.exists():
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            self._write_pins()
        world.barrier()
        self._rewritten = self.last_saved = step
        self._changes.append((step, str(final), "ok"))
        self.save_seconds = time.perf_counter() - t0
        return self.save_seconds

    def drop_after(self, step: int, background: bool = False) -> list[int]:
        """Delete the checkpoints newer than `step` (the abandoned branch): a resume must never
        land on them. Rank 0 deletes; every rank returns the same (never in the background)."""
        self.wait()
        dropped = [s for s in self.retained() if s > step] if self.world.is_main else []
        for s in dropped:
            self._delete(s)
            self.pins.pop(s, None)
        if dropped:
            self._write_pins()
        dropped = list(self.world.agree(dropped))
        for s in dropped:
            self.pins.pop(s, None)
        if self.last_saved is not None and self.last_saved > step:
            held = [s for s in self.retained() if s <= step]
            self.last_saved = held[-1] if held else None
        return dropped

    def pin(self, step: int, reason: str) -> None:
        """Keep `step` whatever retention says (now, or once torchtitan writes it)."""
        self.pins.setdefault(step, set()).add(reason)
        self._write_pins()

    def _write_pins(self) -> None:
        if not self.world.is_main or not self.root.is_dir():
            return
        tmp = self.root / f".{PINS}.tmp"
        tmp.write_text(json.dumps({str(s): sorted(r) for s, r in sorted(self.pins.items())}))
        os.replace(tmp, self.root / PINS)

    # -- a rollback's restore -----------------------------------------------------------------
    def read(self, where: Path) -> dict[str, Any]:
        """Load the checkpoint at `where` in place, on every rank (DCP reshards it): the model,
        the optimizer, the LR schedule and the Watch's state, not the data loader (it flows
        on, past the batches the rollback skips), nor the token count (tokens seen were seen).
        Returns what the core's restore needs: the Watch's state, loaded in place."""
        match = _STEP.match(where.name)
        if match is None or not self.has(int(match.group(1))):
            raise CheckpointError(f"no torchtitan checkpoint at {where}")
        manager, trainer = self.manager, self.train_state
        self.wait()
        excluded = list(manager.exclude_from_loading)
        manager.exclude_from_loading = sorted({*excluded, DATALOADER})
        seen = trainer.ntokens_seen
        trainer.spikewatch_state = None
        try:
            manager.load(step=int(match.group(1)))
        finally:
            manager.exclude_from_loading = excluded
            trainer.ntokens_seen = seen
        state = trainer.spikewatch_state
        if not state:
            raise CheckpointError(f"{where} holds no spikewatch state: not a rollback target")
        return {"trainer.json": state, "in_place": True}
