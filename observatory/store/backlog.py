"""What the sink holds that the database has not taken yet, and the one order it goes in.

Three places, oldest first: the spool file (observatory/store/spool.py), records held in memory
because the spool could not take them (its directory unwritable or full), then the batch the
writer is writing and the queue behind it. Two threads move records between them:

- the writer thread takes a batch off the queue (`take`), writes it, and on a failure hands it to
  `keep`, which spools it (with anything held, held first) or, if the spool fails, holds it;
- the caller's thread (`persist` before a checkpoint, a full queue) moves the batch in flight
  and the queue to the spool at once (`spool_all`), without waiting for a writer that may be
  stuck in a write. The writer then skips a batch moved away from it (`moved`): the spool's
  replay writes it, before anything newer.

One lock (`_order`) covers every append to the spool and every change to the held list, so the
spool holds records in the order they were logged; the condition variable `_cv` covers the
queue and the batch in flight, and is held only for list operations (never for I/O), so
`put` stays microseconds even while the writer spools a large batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from spikewatch.observatory.store.records import Record
from spikewatch.observatory.store.spool import Spool

__all__ = ["Backlog"]

log = logging.getLogger(__name__)

SPOOL_RETRY_S = 5.0  # after the spool failed, the caller's thread tries it again this late
SPOOL_RETRY_WRITER_S = 1.0  # ... and the writer thread (off the training step) this late


class Backlog:
    def __init__(self, spool: Spool, *, queue_size: int, hold_values: int) -> None:
        self.spool = spool
        self.queue_size = queue_size
        self.hold_values = hold_values  # held in memory beyond this: the oldest are lost
        self.spooled = 0  # records appended to the spool file
        self.lost = [0, 0]  # records, metric values (points): what could be kept nowhere
        self._cv = threading.Condition()
        self._items: deque[Any] = deque()  # records, flush events, the stop sentinel (None)
        self._records = 0  # records among _items
        self._inflight: list[Record] | None = None  # the writer's batch (being built or written)
        self._moved = False  # ... and it went to the spool from the caller's thread
        self._order = threading.Lock()
        self._held: list[Record] = []
        self._held_values = 0
        self._held_gen = 0  # bumped when the held records go to the spool
        self._spool_failed_at: float | None = None
        self.spool_error = ""

    # -- the caller's side ----------------------------------------------------------------
    def put(self, item: Any) -> bool:
        """Queue a record (False when the queue is full) or a marker (always queued)."""
        with self._cv:
            if isinstance(item, Record):
                if self._records >= self.queue_size:
                    return False
                self._records += 1
            self._items.append(item)
            self._cv.notify()
        return True

    def spool_all(self, extra: list[Record] | None = None) -> int:
        """Move everything not yet in the database (held, in flight, queued, then `extra`) to the
        spool file, in that order; return how many records went. If the spool cannot take them,
        they stay where they were (and `extra` joins the queue) and 0 is returned."""
        extra = extra or []
        with self._order:
            if self._spool_failed_at is not None:
                if time.monotonic() - self._spool_failed_at < SPOOL_RETRY_S:
                    self._requeue(extra)  # it failed a moment ago: no new attempt per call
                    return 0
            with self._cv:
                inflight = [] if self._moved else list(self._inflight or ())
                queued = [i for i in self._items if isinstance(i, Record)]
                markers = [i for i in self._items if not isinstance(i, Record)]
                self._items = deque(markers)  # flush requests and the stop sentinel stay
                self._records = 0
                if self._inflight is not None:
                    self._moved = True
            records = [*self._held, *inflight, *queued, *extra]
            if records and not self._append(records):
                with self._cv:
                    self._moved = False
                    self._items.extendleft(reversed(queued))
                    self._records += len(queued)
                self._requeue(extra)
                return 0
            self._clear_held()
        return len(records)

    def _requeue(self, records: list[Record]) -> None:
        with self._cv:
            self._items.extend(records)  # past the queue's size: the writer holds or spools them
            self._records += len(records)
            self._cv.notify()

    # -- the writer's side ----------------------------------------------------------------
    def take(self, batch_values: int, linger_s: float) -> tuple[list[Record], list[Any], bool]:
        """Block (up to 0.5 s) for the first record, then take what arrives within `linger_s`,
        up to `batch_values` values. Returns (batch, flush markers, stop)."""
        batch: list[Record] = []
        markers: list[Any] = []
        size = 0
        deadline: float | None = None
        with self._cv:
            self._inflight, self._moved = batch, False
            while size < batch_values and not self._moved:
                if not self._items:
                    wait = 0.5 if deadline is None else deadline - time.monotonic()
                    if wait <= 0 or not self._cv.wait(wait) and not self._items:
                        break
                    continue
                item = self._items.popleft()
                if item is None:
                    return batch, markers, True
                if not isinstance(item, Record):
                    markers.append(item)
                    break  # a flush wants what came before it written now
                self._records -= 1
                batch.append(item)
                size += item.size
                deadline = deadline or time.monotonic() + linger_s
        return batch, markers, False

    def moved(self) -> bool:
        """The batch in flight went to the spool (the writer need not write or keep it)."""
        with self._cv:
            return self._moved

    def done(self) -> None:
        with self._cv:
            self._inflight, self._moved = None, False

    def keep(self, batch: list[Record]) -> None:
        """The database did not take `batch`: into the spool (after anything held), else held."""
        with self._order:
            if self.moved():
                return  # the caller's thread spooled it already
            failed_at = self._spool_failed_at
            if failed_at is None or time.monotonic() - failed_at > SPOOL_RETRY_WRITER_S:
                if self._append([*self._held, *batch]):
                    self._clear_held()
                    return
            self._held.extend(batch)
            self._held_values += sum(r.size for r in batch)
            self._trim_held()

    def held(self) -> tuple[list[Record], int]:
        with self._order:
            return list(self._held), self._held_gen

    def written(self, n: int, gen: int) -> None:
        """The first `n` held records (as of generation `gen`) are in the database."""
        with self._order:
            if gen == self._held_gen:
                gone, self._held = self._held[:n], self._held[n:]
                self._held_values -= sum(r.size for r in gone)

    @property
    def queued(self) -> int:
        """Records waiting in memory for the writer."""
        return self._records

    def pending(self) -> bool:
        """Older records wait (spool or memory): new batches go after them."""
        with self._order:
            return bool(self._held) or self.spool.pending()

    def abandon(self) -> int:
        """The sink stops with records held (the database unreachable, the spool unwritable):
        they are lost. Counted and said; returns how many."""
        with self._order:
            n = len(self._held)
            if n:
                self._lose(self._held, "the sink stopped with them held")
                self._held, self._held_values = [], 0
        return n

    # -- helpers (callers hold _order) -----------------------------------------------------
    def _append(self, records: list[Record]) -> bool:
        try:
            self.spool.append(records)
        except OSError as e:
            first = self._spool_failed_at is None
            self._spool_failed_at = time.monotonic()
            self.spool_error = f"{type(e).__name__}: {e}"
            if first:
                log.error(
                    "spool: cannot write %s (%s); records stay in memory (up to %d values) "
                    "until the database or the spool takes them",
                    self.spool.dir,
                    self.spool_error,
                    self.hold_values,
                )
            return False
        self.spooled += len(records)
        if self._spool_failed_at is not None:
            log.warning("spool: %s takes records again", self.spool.dir)
            self._spool_failed_at, self.spool_error = None, ""
        return True

    def _clear_held(self) -> None:
        if self._held:
            self._held, self._held_values = [], 0
            self._held_gen += 1

    def _trim_held(self) -> None:
        cut = 0
        while self._held_values > self.hold_values and cut < len(self._held) - 1:
            self._held_values -= self._held[cut].size
            cut += 1
        if cut:
            self._lose(self._held[:cut], f"more than {self.hold_values} values held")
            self._held = self._held[cut:]
            self._held_gen += 1

    def _lose(self, records: list[Record], why: str) -> None:
        values = sum(r.size - 1 for r in records if r.kind in ("metrics", "series"))
        self.lost[0] += len(records)
        self.lost[1] += values
        log.error(
            "sink: %d records (%d metric values) LOST: the database is unreachable, the spool "
            "%s cannot take them (%s), and %s; %d records lost so far",
            len(records),
            values,
            self.spool.dir,
            self.spool_error or "unwritable",
            why,
            self.lost[0],
        )
