"""The rollback targets a run keeps, in two tiers, behind the one interface the core uses.

- **Host memory** (memory.py): fast, bounded by a byte budget, lost with the process. A rollback
  restores from here when the target is here: no file is read.
- **Disk** (disk.py, or sharded.py under torchrun): for crashes (a resume reads only disk) and
  for targets older than memory holds.

Each tier has its own interval. `save` writes the tiers that are due (the core's explicit saves,
such as the step-0 anchor and a rollback's rewrite of its target, write every tier that is on).
Retention, pins and abandoned branches apply to both; a rollback goes to the newest retained
step at or before its target in either tier, memory first.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from spikewatch.trainer.checkpoints import format as ck
from spikewatch.trainer.checkpoints.memory import (
    AUTO_BUDGET,
    AUTO_STEPS,
    Lent,
    MemoryTier,
    default_budget_bytes,
    snapshot_bytes,
)
from spikewatch.trainer.checkpoints.staging import FromMemory, Live, NoTensors, Stager
from spikewatch.trainer.config import CheckpointConfig
from spikewatch.trainer.core.world import World, local

__all__ = [
    "DISK",
    "MEMORY",
    "DiskTier",
    "Tiers",
    "build_tiers",
    "describe",
    "estimated_snapshot_bytes",
]

log = logging.getLogger(__name__)

DISK, MEMORY = "disk", "memory"
# a leading signal's pin (trainer/core/guard.py), and how many warnings keep theirs
ANCHOR = "pre-spike anchor"
MAX_ANCHORS = 4


def memory_path(step: int) -> str:
    """How a host-memory snapshot is named in the run's record (there is no file)."""
    return f"memory://step{step:08d}"


class DiskTier(Protocol):
    """What the tiers need of the disk tier: spikewatch's own (disk.py, sharded.py) or a
    framework's checkpoints (spikewatch/torchtitan/checkpoints.py)."""

    root: Path
    cfg: CheckpointConfig
    pins: dict[int, set[str]]
    last_saved: int | None

    @property
    def enabled(self) -> bool: ...
    @property
    def in_background(self) -> bool: ...
    @property
    def awaits(self) -> bool: ...  # takes a step still in flight: `save(awaiting=True)`
    @property
    def takes_lent(self) -> bool: ...  # writes a host-memory snapshot's tensors: `save(lent=)`
    def open(self) -> None: ...
    def due(self, step: int, seconds_per_step: float) -> bool: ...
    def save(
        self,
        step: int,
        build: Callable[[Stager | None], ck.Snapshot],
        awaiting: bool = False,
        lent: Lent | None = None,
    ) -> float | None: ...
    def prepare(self, build: Callable[[Stager | None], ck.Snapshot]) -> None: ...  # ahead
    def complete(self, step: int, trainer: dict[str, Any], meta: dict[str, Any]) -> None: ...
    def drop(self, step: int) -> None: ...
    def before_mutation(self) -> float: ...
    def wait(self) -> None: ...
    def take_changes(self) -> list[tuple[int, str, str]]: ...
    def pin(self, step: int, reason: str) -> None: ...
    def unpin(self, step: int, reason: str) -> None: ...
    def has(self, step: int) -> bool: ...
    def drop_after(self, step: int, background: bool = False) -> list[int]: ...
    def retained(self) -> list[int]: ...
    def latest(
        self, at_most: int | None = None, above: int | None = None
    ) -> tuple[int, Path] | None: ...
    def resume_point(self) -> tuple[int, Path]: ...
    def read(self, path: Path) -> dict[str, Any]: ...
    def path_of(self, step: int) -> Path: ...


class Tiers:
    def __init__(self, disk: DiskTier, memory: MemoryTier | None = None) -> None:
        self.disk = disk
        self.memory = memory
        self.root = disk.root
        self.last_tier: str | None = None  # the tier the last rollback restored from
        self._changes: list[tuple[int, str, str]] = []
        self._mem_seen: set[int] = set()

    # -- what is on --------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.disk.enabled or self.memory is not None

    @property
    def last_saved(self) -> int | None:
        steps = [s for s in (self.disk.last_saved, self._mem_last()) if s is not None]
        return max(steps) if steps else None

    @last_saved.setter
    def last_saved(self, step: int | None) -> None:
        self.disk.last_saved = step

    @property
    def pins(self) -> dict[int, set[str]]:
        out = {s: set(p) for s, p in self.disk.pins.items()}
        for s, slot in self.memory.slots.items() if self.memory else ():
            out.setdefault(s, set()).update(slot.pins)
        return {s: p for s, p in out.items() if p}

    def _mem_last(self) -> int | None:
        return None if self.memory is None else self.memory.last_saved

    def open(self) -> None:
        self.disk.open()

    # -- timing and saving --------------------------------------------------------------------
    def due(self, step: int, seconds_per_step: float) -> list[str]:
        """The tiers whose interval says: save now."""
        due = []
        memory = self.memory
        if memory is not None and self._mem_last() != step and memory.due(step, seconds_per_step):
            due.append(MEMORY)
        if self.disk.enabled and self.disk.last_saved != step:
            if self.disk.due(step, seconds_per_step):
                due.append(DISK)
        if due == [DISK] and memory is not None and self._mem_last() != step:
            if self.disk.takes_lent and memory.lends:
                # a snapshot too: the file takes its tensors (`save`), cheaper for the loop than
                # the file's own walk and copy, and the step is a rollback target in memory
                due.insert(0, MEMORY)
        return due

    def save(
        self,
        step: int,
        build: Callable[[Stager | None], ck.Snapshot],
        tiers: Collection[str] | None = None,
        awaiting: bool = False,
    ) -> dict[str, float]:
        """Save `step` to `tiers` (None: every tier that is on); returns each tier's stall.
        `awaiting`: `step` is still on the device; its snapshot (host memory; on disk when the
        disk tier `awaits`, else the caller drained first) is completed or dropped once the
        step is decided (`complete`, `drop`)."""
        stalls: dict[str, float] = {}
        memory = self.memory is not None and (tiers is None or MEMORY in tiers)
        disk = self.disk.enabled and (tiers is None or DISK in tiers)
        live, lent = None, None
        if memory and disk and self.disk.in_background:  # one build for both
            t0 = time.perf_counter()
            # the disk writes host memory's copy of the weights and optimizer state (`lend`):
            # neither their state dicts nor a second copy from the device on the loop thread
            live = build(FromMemory() if self.disk.takes_lent else Live())
            built = time.perf_counter() - t0
        if memory:
            assert self.memory is not None
            pins = self.pins.get(step, set())
            snap = live if live is not None else build(NoTensors())
            stalls[MEMORY] = self.memory.save(step, snap, pins, awaiting)
            if live is not None and self.disk.takes_lent:
                lent = self.memory.lend(step)  # None: not held (the budget), or no files made
            if self.memory.has(step):
                self._changes.append((step, memory_path(step), "ok"))
        if disk:
            # the snapshot built above, unless it left out the tensors and memory lent none
            whole = live is not None and (lent is not None or not self.disk.takes_lent)
            made = build
            if live is not None and whole:
                made = lambda stage: live  # noqa: E731 (the one snapshot built above)
            # None: this tier does not keep that step
            stall = self.disk.save(step, made, awaiting=awaiting, lent=lent)
            if stall is not None and whole:
                stall += built
            if stall is not None:
                stalls[DISK] = stall
        return stalls

    def complete(self, step: int, trainer: dict[str, Any], meta: dict[str, Any]) -> None:
        """An awaiting snapshot's step was decided and applied: host memory holds it as a
        rollback target from now on (memory.py), the disk tier writes it (disk.py)."""
        if self.memory is not None and self.memory.complete(step, trainer, meta):
            self._changes.append((step, memory_path(step), "ok"))
        if self.disk.enabled:
            self.disk.complete(step, trainer, meta)

    def drop(self, step: int) -> None:
        """An awaiting snapshot's step was refused or abandoned: the snapshot goes, in both
        tiers."""
        if self.memory is not None:
            self.memory.drop(step)
        if self.disk.enabled:
            self.disk.drop(step)

    def before_mutation(self) -> float:
        waited = self.disk.before_mutation()
        if self.memory is not None:
            waited += self.memory.before_mutation()
        return waited

    def wait(self) -> None:
        self.disk.wait()
        if self.memory is not None:
            self.memory.before_mutation()

    def report(self, callbacks: Iterable[Any]) -> None:
        """Tell the callbacks which snapshots landed or went, in either tier."""
        mem_gone = self._memory_evictions()
        changes, self._changes = self._changes + mem_gone, []
        for step, path, status in [*changes, *self.disk.take_changes()]:
            pinned = step in self.pins
            for cb in callbacks:
                cb.on_checkpoint_change(step, path, status, pinned)

    def _memory_evictions(self) -> list[tuple[int, str, str]]:
        if self.memory is None:
            return []
        held = set(self.memory.steps())  # an awaiting snapshot is not held yet
        seen, self._mem_seen = self._mem_seen, held
        return [(s, memory_path(s), "deleted") for s in sorted(seen - held)]

    # -- pins and branches ----------------------------------------------------------------
    def pin(self, step: int, reason: str) -> None:
        """Protect `step` from retention in every tier that holds it (or, on disk, will)."""
        placed = False
        if self.memory is not None and self.memory.has(step):
            self.memory.pin(step, reason)
            placed = True
        disk = self.disk
        if disk.enabled:
            held = disk.has(step)
            if held or disk.last_saved is None or step > disk.last_saved or not placed:
                disk.pin(step, reason)

    def pin_newest(self, reason: str) -> None:
        """A leading signal's pre-spike anchor: the newest step of each tier (host memory may
        not hold its newest for long, and a rollback may need to go further back than it).
        Anchors are the newest `MAX_ANCHORS` warnings' only: an older one goes back to
        retention, which keeps or drops it by age as any other (a long run's warnings would
        otherwise hold a snapshot each for ever, and what the loop walks would grow)."""
        newest, disk = self.last_saved, self.disk
        if newest is None:
            return
        self.pin(newest, reason)
        older = disk.last_saved if disk.enabled else None
        if older is not None and older != newest:
            disk.wait()
            if disk.has(older):
                disk.pin(older, reason)
        self._release_anchors()

    def _release_anchors(self) -> None:
        anchors = [
            (s, r) for s, reasons in self.pins.items() for r in reasons if r.startswith(ANCHOR)
        ]
        newest: dict[str, int] = {}  # each warning's anchors (both tiers'), by its newest step
        for s, r in anchors:
            newest[r] = max(s, newest.get(r, s))
        kept = set(sorted(newest, key=newest.__getitem__)[-MAX_ANCHORS:])
        for s, r in anchors:
            if r not in kept:
                if self.memory is not None:
                    self.memory.unpin(s, r)
                if self.disk.enabled:
                    self.disk.unpin(s, r)

    def drop_after(self, step: int, background: bool = False) -> list[int]:
        """The steps after `step` go from both tiers. `background` (a rollback, its target
        just saved again): the disk's go once that save is written, on its writer thread, and
        are not in the list returned."""
        dropped = set(self.disk.drop_after(step, background))
        if self.memory is not None:
            dropped |= set(self.memory.drop_after(step))
        return sorted(dropped)

    def retained(self) -> list[int]:
        """Steps a rollback can go to, in either tier."""
        steps = set(self.disk.retained()) if self.disk.enabled else set()
        if self.memory is not None:
            steps |= set(self.memory.steps())
        return sorted(steps)

    def rollback_point(self, to_step: int) -> tuple[int, Path | int, list[int]]:
        """The newest retained step at or before `to_step` (memory first on a tie), where it is
        (a disk path, or the step itself for host memory), and the abandoned newer steps."""
        if not self.enabled:
            raise RuntimeError(f"Rollback(to_step={to_step}) needs checkpoints: set an interval")
        mem = [s for s in (self.memory.steps() if self.memory else []) if s <= to_step]
        # the disk is asked only for a step newer than host memory's: verifying a file's
        # checksums (a read of all of it, ~12 GB at 1B with AdamW) for a target host memory
        # wins anyway cost the loop seconds a rollback
        above = mem[-1] if mem else None
        found = self.disk.latest(at_most=to_step, above=above) if self.disk.enabled else None
        newer = set(self.retained())
        if mem and (found is None or mem[-1] >= found[0]):
            self.last_tier = MEMORY
            return mem[-1], mem[-1], sorted(s for s in newer if s > mem[-1])
        if found is None:
            raise ck.CheckpointError(f"no retained checkpoint at or before step {to_step}")
        self.last_tier = DISK
        return found[0], found[1], sorted(s for s in newer if s > found[0])

    def resume_point(self) -> tuple[int, Path]:
        """For a resume after a crash: disk only (host memory died with the process)."""
        return self.disk.resume_point()

    def latest(self, at_most: int | None = None) -> tuple[int, Path | int] | None:
        mem = [
            s
            for s in (self.memory.steps() if self.memory else [])
            if at_most is None or s <= at_most
        ]
        above = mem[-1] if mem else None  # (as rollback_point: no check of a file that loses)
        found = self.disk.latest(at_most, above) if self.disk.enabled else None
        if mem and (found is None or mem[-1] >= found[0]):
            return mem[-1], mem[-1]
        return found

    def read(self, where: Path | int) -> dict[str, Any]:
        """A checkpoint's state on the host (tensors on the CPU; a memory snapshot's copy back
        happens in place at restore)."""
        if isinstance(where, int):
            assert self.memory is not None
            return self.memory.read(where)
        return self.disk.read(where)

    def path_of(self, step: int, tier: str) -> str:
        return memory_path(step) if tier == MEMORY else str(self.disk.path_of(step))


def describe(tiers: Tiers, per_snapshot: int, max_steps: int | None) -> str:
    """One line for the user at start: where rollback targets go, how often, how many and how
    big they get (exponential retention keeps about keep_last + log2(steps / interval) + 1
    of a tier's saves, plus the newest MAX_ANCHORS warnings' pre-spike anchors)."""
    size = human_bytes(per_snapshot)
    parts = []

    def count(interval: int | str | None, keep_last: int, room: int | None = None) -> str:
        """How many of a tier's saves retention keeps at the end of the run."""
        if max_steps is None or not isinstance(interval, int):
            kept = "about 2 + log2(steps / interval)"
            return kept if room is None else f"{kept}, at most {room}"
        saves = max(1, max_steps // interval)
        n = min(saves, keep_last + int(math.log2(saves)) + 1)
        return f"at most {n if room is None else min(n, room)}"

    mem = tiers.memory
    if mem is not None:
        room = min(mem.capacity(per_snapshot), 10**6)
        lo, hi = AUTO_STEPS
        every = (
            f"every {lo} to {hi} steps as each costs (at most {AUTO_BUDGET:.1%} of the step "
            "time, measured)"
            if mem.auto
            else f"every {mem.interval} steps"
        )
        parts.append(
            f"host memory {every}, ~{size} each, "
            f"{count(hi if mem.auto else mem.interval, mem.keep_last, room)} kept "
            f"(a budget of {human_bytes(mem.budget_bytes)})"
        )
    cfg = tiers.disk.cfg
    if tiers.disk.enabled:
        every = "at Young/Daly's interval" if cfg.interval == "auto" else f"every {cfg.interval}"
        n = count(cfg.interval, cfg.keep_last)
        how = ", written in the background" if tiers.disk.in_background else ""
        parts.append(f"disk {every} steps in {tiers.root}{how}, ~{size} each, {n} kept")
    if not parts:
        return "no rollback checkpoints: spikes are recorded, never rolled back"
    return "rollback checkpoints: " + "; ".join(parts)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def estimated_snapshot_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """One snapshot's bytes on this rank, before the optimizer has made its state: Adam-like
    optimizers (betas) keep two tensors per parameter, momentum ones one."""
    now = snapshot_bytes(model, optimizer)
    if any(optimizer.state.values()):
        return now
    defaults = optimizer.defaults
    moments = 2 if "betas" in defaults else 1 if defaults.get("momentum") else 0
    params = sum(
        local(p).numel() * local(p).element_size()
        for g in optimizer.param_groups
        for p in g["params"]
    )
    return now + moments * params


def build_tiers(
    cfg: CheckpointConfig,
    disk: DiskTier,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    world: World,
) -> Tiers:
    """The disk tier given, and the host-memory tier when `cfg.memory_interval` is set, with a
    budget every rank agrees on (rank 0's)."""
    memory = None
    if cfg.memory_interval is not None:
        mb = cfg.memory_budget_mb
        budget = int(mb * 2**20) if mb is not None else default_budget_bytes()
        memory = MemoryTier(
            model,
            optimizer,
            interval=cfg.memory_interval,
            budget_bytes=int(world.agree(budget)),
            keep_last=cfg.keep_last,
            agree=world.min_int,
        )
    return Tiers(disk, memory)
