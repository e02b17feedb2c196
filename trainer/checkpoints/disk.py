"""When to save, how (sync or one background save in flight), what to keep, and pins.

The loop hands over a `Snapshot` builder; this class decides the timing (`checkpoint.interval`,
or Young/Daly from the measured save cost with `interval = "auto"`), writes, prunes with the
exponential retention of `retention.keep`, and never deletes a pinned checkpoint. Pins are kept
in each checkpoint's meta.json, so they survive a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spikewatch.observatory.goodput.young_daly import daly
from spikewatch.observatory.retention import keep
from spikewatch.trainer.checkpoints import format as ck
from spikewatch.trainer.checkpoints.memory import Lent
from spikewatch.trainer.checkpoints.pinned import Events, SideCopies, device_wait, host_wait
from spikewatch.trainer.checkpoints.staging import (
    Live,
    Queued,
    Stager,
    has_cuda,
    leaves_of,
    stage_tensors,
)
from spikewatch.trainer.checkpoints.worker import Worker, worker
from spikewatch.trainer.config import CheckpointConfig

__all__ = ["AUTO_FIRST_SAVE", "Checkpointer"]

log = logging.getLogger(__name__)

AUTO_FIRST_SAVE = 5  # with interval="auto", the first save (at this step) measures the cost


@dataclass
class _Undecided:
    """A save of a step still on the device (read late): its tensors are being copied; its
    file is written once the step is decided and applied (`complete`), or never (`drop`)."""

    snap: ck.Snapshot
    events: Events
    before: int | None  # the last save before it, for a drop


class Checkpointer:
    def __init__(
        self,
        root: Path,
        cfg: CheckpointConfig,
        *,
        before_commit: Callable[[], object] | None = None,
    ) -> None:
        """`before_commit`: called (on the thread that writes) right before a checkpoint is
        published; the run's record makes everything logged so far durable there, so that a
        resume from this checkpoint, which re-sends only the steps after it, loses nothing."""
        self.root = root
        self.cfg = cfg
        self.before_commit = before_commit
        self.pins: dict[int, set[str]] = {}
        self.last_saved: int | None = None
        self.save_seconds: float | None = None  # what a save costs the loop (stall if async)
        self.auto_interval: int | None = None
        self._stager = Stager()
        self._copies = SideCopies()
        self._events: Events = []  # CUDA copies of the save in flight, for before_mutation
        self._thread: Future[None] | None = None  # the writer's last job
        self._copied: threading.Event | None = None
        self._error: BaseException | None = None
        self._changes: list[tuple[int, str, str]] = []  # (step, path, "ok" | "deleted")
        self._changes_lock = threading.Lock()
        self._undecided: _Undecided | None = None
        self._retake = False  # an awaiting save was dropped: the next step is due
        self._verified: Path | None = None  # `latest`'s find, its checksums just verified

    @property
    def awaits(self) -> bool:
        """A save may take a step still in flight (`save(awaiting=True)`): background saves."""
        return self.cfg.async_save

    @property
    def takes_lent(self) -> bool:
        """Writes a host-memory snapshot's weights and optimizer state (`save(lent=)`): a
        background save, whose writer thread copies them."""
        return self.cfg.async_save

    @property
    def enabled(self) -> bool:
        return self.cfg.interval is not None

    @property
    def in_background(self) -> bool:
        """Saves are written by a background thread (`async_save`)."""
        return self.cfg.async_save

    def open(self) -> None:
        """Clean half-written checkpoints of a killed process; load pins from disk."""
        ck.clean_temporaries(self.root)
        for step, path in ck.list_checkpoints(self.root).items():
            try:
                pins = ck.read_meta(path).get("pins", [])
            except ck.CheckpointError:
                continue
            if pins:
                self.pins[step] = set(pins)

    # -- timing ---------------------------------------------------------------------------
    def due(self, step: int, seconds_per_step: float) -> bool:
        interval = self.cfg.interval
        if interval is None:
            return False
        if self._retake:  # the save due before was of a step that turned out refused
            return True
        if interval != "auto":
            return step % interval == 0
        if self.save_seconds is None:  # nothing measured yet (a new run, or just resumed)
            return step - (self.last_saved or 0) >= AUTO_FIRST_SAVE
        self.auto_interval = self.interval_for(seconds_per_step)
        return step - (self.last_saved or 0) >= self.auto_interval

    def interval_for(self, seconds_per_step: float) -> int:
        """Daly's interval in steps for the measured save cost and the configured MTBF."""
        assert self.save_seconds is not None
        cost = max(self.save_seconds, 1e-6)
        seconds = daly(cost, self.cfg.mtbf_hours * 3600)
        return max(1, round(seconds / max(seconds_per_step, 1e-9)))

    # -- saving ---------------------------------------------------------------------------
    def prepare(self, build: Callable[[Stager | None], ck.Snapshot]) -> None:
        """Ahead of a save (the loop calls it once the state's shapes are known, and again
        when they change: the optimizer's state appearing): an async save of CUDA tensors
        copies into one pinned host block, which the writer thread makes and pins now, not
        the loop at the save (~1 GB at 124M with AdamW; a registration a tensor before)."""
        if not (self.enabled and self.cfg.async_save):
            return
        snap = build(Live())
        if has_cuda(snap.torch_files):
            self._stager.prepare(leaves_of(snap.torch_files), self._writer().submit)

    def save(
        self,
        step: int,
        build: Callable[[Stager | None], ck.Snapshot],
        awaiting: bool = False,
        lent: Lent | None = None,
    ) -> float:
        """Save the state of `step`; returns how long this call blocked the loop (seconds).

        Synchronous: written before returning. Asynchronous: the snapshot holds the live
        tensors; a background thread first copies them into reused host buffers, then writes.
        The loop only waits (`before_mutation`) if it is about to change the weights or the
        optimizer state while that copy is still running, so the copy overlaps the next
        forward and backward, and the write overlaps everything.

        `awaiting` (asynchronous only): the step is still on the device, read late; `build`
        leaves out what its decision changes. The copy starts now as above; the file is
        written once the step is decided and applied (`complete` fills in the rest), or not at
        all (`drop`: the step was refused, or a rollback abandoned it). The loop waits for
        nothing: the step in flight is not drained.

        `lent` (asynchronous only): the weights and optimizer state are those of the host-memory
        snapshot of the same step (`build` left them out): the writer thread takes them from
        it, so the loop neither builds their state dicts nor copies them from the device.
        """
        t0 = time.perf_counter()
        try:
            if lent is not None and not self.cfg.async_save:
                raise ValueError("a synchronous save builds its own snapshot: nothing is lent")
            self.wait()
        except BaseException:
            if lent is not None:
                lent.release()  # host memory may reuse its buffers: no file will read them
            raise
        if awaiting and not self.awaits:
            raise ValueError("a synchronous save cannot take a step still in flight")
        self._undecided = None
        self._retake = False
        pins = {s: set(p) for s, p in self.pins.items()}
        if self.cfg.async_save:
            snap = build(Live())
            snap.json_files = ck.copied(snap.json_files)  # small, and mutable in the loop
            snap.meta = ck.copied(snap.meta)
            self._copied = threading.Event()
            events: Events = []
            if lent is not None:  # the writer copies host memory's buffers: no live tensor
                self._copied.set()
            elif has_cuda(snap.torch_files):  # queued here on side streams, into pinned memory
                queued = Queued(self._stager)
                snap.torch_files = stage_tensors(snap.torch_files, queued)
                events = self._events = queued.start(self._copies)
                self._copied.set()  # the loop's streams wait for the copies (before_mutation)
            if awaiting:
                self._undecided = _Undecided(snap, events, self.last_saved)
                if not events:  # host tensors: the writer copies them, the write waits
                    self._thread = self._writer().submit(self._stage, snap, lent)
            else:
                self._thread = self._writer().submit(
                    self._stage_and_write, snap, pins, events, lent
                )
        else:
            self._write(build(None), pins)
        stall = time.perf_counter() - t0
        self.save_seconds = stall
        self.last_saved = step
        return stall

    def complete(self, step: int, trainer: dict[str, Any], meta: dict[str, Any]) -> None:
        """The awaiting save's step was decided and applied: its state as decided fills the
        parts left open, and the writer thread takes it (after the copy, on its own thread).
        Pins are read now: a pin placed while the step was in flight is kept."""
        undecided = self._undecided
        if undecided is None or undecided.snap.step != step:
            return
        self._undecided = None
        snap = undecided.snap
        snap.json_files["trainer.json"].update(ck.copied(trainer))
        snap.meta.update(ck.copied(meta))
        pins = {s: set(p) for s, p in self.pins.items()}
        copier, self._thread = self._thread, None
        self._thread = self._writer().submit(
            self._write_after, copier, snap, pins, undecided.events
        )

    def drop(self, step: int) -> None:
        """The awaiting save's step was refused: no file, and the next step is due instead (a
        refused step is rare; a file an interval later would leave a crash twice the work to
        redo). The save before it is the last again, and takes the pins placed meanwhile."""
        undecided = self._undecided
        if undecided is None or undecided.snap.step != step:
            return
        self.wait()  # the copy (its buffers are reused by the next save)
        self._undecided = None
        self._retake = True
        if self.last_saved == step:
            self.last_saved = undecided.before
        moved = self.pins.pop(step, set())
        if moved and undecided.before is not None and self.has(undecided.before):
            for reason in sorted(moved):
                self.pin(undecided.before, reason)

    def _stage(self, snap: ck.Snapshot, lent: Lent | None = None) -> None:
        """An awaiting save's copy of host tensors (its write waits for the decision)."""
        try:
            snap.torch_files = _staged(snap, self._stager, lent)
        except BaseException as e:
            self._error = e
        finally:
            if self._copied is not None:
                self._copied.set()

    @staticmethod
    def _writer() -> Worker:
        """The long-lived thread that copies and writes, in order (worker.py)."""
        return worker("ckpt-writer")

    def _write_after(
        self,
        copier: Future[None] | None,
        snap: ck.Snapshot,
        pins: dict[int, set[str]],
        events: Events,
    ) -> None:
        if copier is not None:
            copier.result()  # run before this on the same thread: done
        if self._error is not None:
            return
        try:
            if events:
                host_wait(events)
        except BaseException as e:
            self._error = e
            return
        self._write_guarded(snap, pins)

    def before_mutation(self) -> float:
        """Block until an async save has copied the tensors; returns the seconds waited."""
        if self._events:  # CUDA: the device orders the update after the copies; no host wait
            device_wait(self._events)
            self._events = []
            self._copies.release()  # the sources are free to change or go
        if self._copied is None:
            return 0.0
        t0 = time.perf_counter()
        self._copied.wait()
        self._copied = None
        waited = time.perf_counter() - t0
        if self.save_seconds is not None:
            self.save_seconds += waited  # what the save cost the loop, for interval="auto"
        return waited

    def _stage_and_write(
        self,
        snap: ck.Snapshot,
        pins: dict[int, set[str]],
        events: Events,
        lent: Lent | None = None,
    ) -> None:
        try:
            if events:
                host_wait(events)  # this thread waits for the side-stream copies, not the loop
            else:
                snap.torch_files = _staged(snap, self._stager, lent)
        except BaseException as e:
            self._error = e
            return
        finally:
            if self._copied is not None:
                self._copied.set()
        self._write_guarded(snap, pins)

    def _write_guarded(self, snap: ck.Snapshot, pins: dict[int, set[str]]) -> None:
        try:
            self._write(snap, pins)
        except BaseException as e:  # re-raised in the loop's thread by wait()
            self._error = e

    def _write(self, snap: ck.Snapshot, pins: dict[int, set[str]]) -> None:
        snap.meta["pins"] = sorted(pins.get(snap.step, ()))
        if self.before_commit is not None:
            self.before_commit()
        path = ck.write_checkpoint(self.root, snap, fsync=self.cfg.fsync)
        log.debug("saved %s", path)
        self._changed(snap.step, "ok", path)
        self._prune(snap.step, pins)

    def _prune(self, now: int, pins: dict[int, set[str]]) -> None:
        existing = {s: p for s, p in ck.list_checkpoints(self.root).items() if s <= now}
        kept = keep(existing, now, pins=pins, keep_last=self.cfg.keep_last)
        for step, path in existing.items():
            if step not in kept:
                ck.delete_checkpoint(path)
                self._changed(step, "deleted", path)

    def _changed(self, step: int, status: str, path: Path) -> None:
        with self._changes_lock:  # the writer thread of an async save notes them too
            self._changes.append((step, str(path), status))

    def report(self, callbacks: Iterable[Any]) -> None:
        """Tell the callbacks (`on_checkpoint_change`) which checkpoints landed or were deleted
        since the last report; called from the loop's thread."""
        for step, path, status in self.take_changes():
            pinned = step in self.pins
            for cb in callbacks:
                cb.on_checkpoint_change(step, path, status, pinned)

    def take_changes(self) -> list[tuple[int, str, str]]:
        """Checkpoints that landed ("ok") or were deleted ("deleted") since the last call, as
        (step, path, status): the loop tells its callbacks (the run's record) from its thread."""
        with self._changes_lock:
            out, self._changes = self._changes, []
        return out

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk, or, for a step still
        undecided, copied; re-raise its error."""
        if self._thread is not None:
            self._thread.result()
            self._thread = None
            self._events = []  # the thread waited for the side-stream copies
        elif self._undecided is None:
            self._events = []
        # else: an undecided step's copies on side streams, for before_mutation to order
        self._copied = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background checkpoint save failed: {err}") from err

    # -- pins and branches ----------------------------------------------------------------
    def path_of(self, step: int) -> Path:
        return ck.step_dir(self.root, step)

    def has(self, step: int) -> bool:
        """A complete checkpoint of `step` is on disk."""
        return (ck.step_dir(self.root, step) / ck.META).exists()

    def pin(self, step: int, reason: str) -> None:
        """Protect the checkpoint of `step` from retention (now, or once it is written)."""
        self.wait()
        if self._undecided is not None and self._undecided.snap.step == step:
            self.pins.setdefault(step, set()).add(reason)  # written with it, if it is
            return
        path = ck.step_dir(self.root, step)
        exists = (path / ck.META).exists()
        if not exists and self.last_saved is not None and step <= self.last_saved:
            raise ck.CheckpointError(f"cannot pin step {step}: no checkpoint of it is kept")
        self.pins.setdefault(step, set()).add(reason)
        if exists:
            ck.write_pins(path, sorted(self.pins[step]))

    def unpin(self, step: int, reason: str) -> None:
        """Give the checkpoint of `step` back to retention for `reason` (other pins stay)."""
        self.wait()
        held = self.pins.get(step)
        if held is None or reason not in held:
            return
        held.discard(reason)
        if not held:
            del self.pins[step]
        path = ck.step_dir(self.root, step)
        if (path / ck.META).exists():
            ck.write_pins(path, sorted(held))

    def drop_after(self, step: int, background: bool = False) -> list[int]:
        """Delete checkpoints newer than `step`: after a rollback they hold the abandoned branch,
        and a later resume must never land on them. `background`, with a save in flight (a
        rollback's target saved again as the next generation): they are deleted by the
        writer thread once that save is written, not before (a crash in between resumes from
        the target all the same: the newest generation wins), and the loop does not wait for
        the write (a file of the whole state: seconds at 1B). Returns the steps deleted (none
        yet, in the background). Anything that lists the checkpoints waits for it (`wait`)."""
        undecided = self._undecided
        if undecided is not None and undecided.snap.step > step:
            self._undecided = None  # never written
            if self.last_saved == undecided.snap.step:
                self.last_saved = undecided.before
        if background and self._thread is not None and self.cfg.async_save:
            for s in [s for s in self.pins if s > step]:
                del self.pins[s]  # here: the loop's own dict
            written = self._thread
            self._thread = self._writer().submit(self._drop_when_written, written, step)
            return []
        self.wait()
        dropped = self._delete_after(step)
        for s in dropped:
            self.pins.pop(s, None)
        return dropped

    def _delete_after(self, step: int) -> list[int]:
        """The files after `step` deleted (on either thread: the pins are the loop's to drop,
        `drop_after`, never this, which the writer thread runs too)."""
        dropped = []
        for s, path in ck.list_checkpoints(self.root).items():
            if s > step:
                ck.delete_checkpoint(path)
                dropped.append(s)
                self._changed(s, "deleted", path)
        return dropped

    def _drop_when_written(self, written: Future[None], step: int) -> None:
        """On the writer thread, after the save `written` (run before this on the same
        thread). A save that failed leaves its error for the loop's next `wait`, and the
        abandoned steps stay: the target's next generation is not on disk to win a resume."""
        written.result()
        if self._error is None:
            try:
                self._delete_after(step)
            except BaseException as e:
                self._error = e

    def rollback_point(self, to_step: int) -> tuple[int, Path, list[int]]:
        """For a rollback: the newest intact checkpoint at or before `to_step`, and the steps
        of the newer ones (the abandoned branch). Those are deleted (`drop_after`) only once
        the target has been saved again with the next generation, so that a crash at any
        moment resumes from the target, with what the rollback decided."""
        if not self.enabled:
            raise RuntimeError(f"Rollback(to_step={to_step}) needs checkpoints: set an interval")
        found = self.latest(at_most=to_step)
        if found is None:
            raise ck.CheckpointError(f"no intact checkpoint at or before step {to_step}")
        step, path = found
        return step, path, [s for s in ck.list_checkpoints(self.root) if s > step]

    def resume_point(self) -> tuple[int, Path]:
        """For a resume: the newest intact checkpoint of the newest generation; newer steps
        failed verification or belong to a branch a rollback abandoned, and are deleted; it
        counts as the last save."""
        found = self.latest()
        if found is None:
            raise ck.CheckpointError(f"no intact checkpoint under {self.root}")
        step, path = found
        self.drop_after(step)
        self.last_saved = step
        return step, path

    def retained(self) -> list[int]:
        """Steps of the checkpoints on disk, once the save in flight (and its pruning) is done."""
        self.wait()
        return list(ck.list_checkpoints(self.root))

    def latest(
        self, at_most: int | None = None, above: int | None = None
    ) -> tuple[int, Path] | None:
        """The newest intact checkpoint at or before `at_most`; only among those after `above`
        (None: any), so that no file that would lose to another tier is read to be checked."""
        self.wait()
        found = ck.find_intact(self.root, at_most, above)
        self._verified = found[1] if found is not None else None
        return found

    def read(self, path: Path) -> dict[str, Any]:
        """What `snapshot.restore` needs from the checkpoint at `path` (verified first, unless
        `latest` has just found it by verifying it: a rollback read every byte twice)."""
        verified, self._verified = self._verified == path, None
        return ck.read_checkpoint(path, verified=verified)


def _staged(snap: ck.Snapshot, stager: Stager, lent: Lent | None) -> dict[str, Any]:
    """The snapshot's torch files with every tensor copied into the stager's host blocks,
    host memory's lent weights and optimizer state among them; the loan is given back once
    copied, or if the copy fails."""
    try:
        files = snap.torch_files if lent is None else {**snap.torch_files, **lent.files()}
        return stage_tensors(files, stager, wait=False)  # (on the writer thread)
    finally:
        if lent is not None:
            lent.release()
