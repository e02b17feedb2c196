"""The trainer-side writer: the training step never waits on the database.

API (the same on `DbSink` and on `NullSink`, which stores nothing)::

    sink = DbSink(url, spool_dir=run_dir / "spool")   # or NullSink()
    sink.start_run(run_id, name=..., config=cfg_dict, tags=[...], sweep_group=..., hypothesis=...,
                   run_dir=...)                          # branch 0 comes with the run
    sink.log_metrics(run_id, branch, step, {"train/loss": 2.3, "layer/0/grad_norm": 0.1, ...})
    sink.log_series(run_id, branch, {"train/loss": (steps, values), ...})  # many steps at once
    sink.start_branch(run_id, 1, parent=0, fork_step=120, reason="rollback after spike at 131")
    sink.log_event(run_id, "rollback", step=131, branch=0, message=..., data={...})
    sink.log_checkpoint(run_id, step=120, path=..., pinned=True, checksum_status="ok")
    sink.set_status(run_id, "completed")
    sink.flush(timeout=10)   # optional: wait until everything so far is in the database
    sink.close()

Every public method validates on the caller's thread (a bad value raises `RecordError` naming
it, and nothing of that call is queued), then enqueues one record: a `put_nowait` on a bounded
queue. A writer thread drains the queue in batches (up to `batch_values` metric values, or
whatever arrived within `linger_s`) and writes each batch in one transaction
(observatory/store/ingest.py). A writer that fell behind takes up to a million values at once: the
store rewrites each series' newest window once per batch, so a 70B model's 6,000 values a step
go in at 2.5M values/s (the writer alone) in batches of 168 steps and at 0.17M in batches of 8.
When the queue is full the record goes to the spool file instead of blocking. When the database
is unreachable, batches go to the spool in the run directory; the writer retries with backoff
and replays the spool, oldest first, before writing anything new. Writes are idempotent, so a
replay never duplicates a row. NaN and +-inf are valid values.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from observatory.alerts import ALERT_KINDS, Alerter, urls_from
from observatory.store.db import make_engine, redact, resolve_url
from observatory.store.ingest import Writer
from observatory.store.records import (
    MetricsChecker,
    Record,
    RecordError,
    check_branch,
    check_run_key,
    check_step,
    check_text,
    checkpoint_record,
    event_record,
    run_record,
    status_record,
)
from observatory.store.spool import Spool

__all__ = ["BaseSink", "DbSink", "NullSink", "RecordError", "open_run_sink"]

log = logging.getLogger(__name__)


class BaseSink:
    """Public methods validate and build records; `_put` (per sink) does the work."""

    def __init__(self) -> None:
        self._check_metrics = MetricsChecker()
        self._branches: dict[str, set[int]] = {}
        self.alerts: Alerter | None = None  # events of ALERT_KINDS also go to the webhooks

    def start_run(
        self,
        run_id: str,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        tags: Iterable[str] = (),
        sweep_group: str | None = None,
        hypothesis: str | None = None,
        run_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """Create the run (or mark a resumed one running again) with its branch 0."""
        rec = run_record(
            run_id,
            config=config or {},
            tags=list(tags) if not isinstance(tags, str) else tags,
            name=name,
            sweep_group=sweep_group,
            hypothesis=hypothesis,
            run_dir=None if run_dir is None else str(run_dir),
        )
        self._branches.setdefault(run_id, set()).add(0)
        self._put(rec)

    def start_branch(
        self, run_id: str, branch: int, *, parent: int, fork_step: int, reason: str = ""
    ) -> None:
        """A rollback: `branch` continues after `fork_step`, the last step shared with `parent`."""
        known = self._known_branches(run_id)
        branch, parent = check_branch(branch), check_branch(parent, "parent")
        if parent not in known:
            raise RecordError(f"parent branch {parent} of run {run_id!r} was never started")
        if branch == parent:
            raise RecordError(f"branch {branch} cannot be its own parent")
        data = {
            "number": branch,
            "parent": parent,
            "fork_step": check_step(fork_step, "fork_step"),
            "reason": check_text("reason", reason) or "",
        }
        known.add(branch)
        self._put(Record("branch", run_id, data))

    def know_branches(self, run_id: str, branches: Iterable[int]) -> None:
        """Branches the store holds already (a resumed run whose forks are not known): accept
        records for them without writing the branches again."""
        self._known_branches(run_id).update(check_branch(b) for b in branches)

    def log_metrics(
        self, run_id: str, branch: int, step: int, metrics: Mapping[str, float]
    ) -> None:
        """One step's values, `{metric name: number}`; the hot path (microseconds)."""
        if branch not in self._known_branches(run_id):
            raise RecordError(f"branch {branch!r} of run {run_id!r} was never started")
        if type(step) is not int or not 0 <= step < 2**31:
            check_step(step)
        values = self._check_metrics(metrics)
        self._put(Record("metrics", run_id, {"branch": branch, "step": step, "values": values}))

    def log_series(
        self, run_id: str, branch: int, series: Mapping[str, tuple[Iterable[int], Iterable[float]]]
    ) -> None:
        """Many steps at once, `{metric name: (steps, values)}` (an import: one record, not one
        per step)."""
        if branch not in self._known_branches(run_id):
            raise RecordError(f"branch {branch!r} of run {run_id!r} was never started")
        columns = self._check_metrics.series(series)
        self._put(Record("series", run_id, {"branch": branch, "series": columns}))

    def log_event(
        self,
        run_id: str,
        kind: str,
        *,
        step: int | None = None,
        branch: int = 0,
        message: str = "",
        data: Mapping[str, Any] | None = None,
        source: str = "trainer",
        uid: str | None = None,
    ) -> str:
        """A spike verdict, an intervention or an annotation; returns its uid (the replay key).

        Without `uid`, the uid is a digest of the event's content: a resumed run that
        recomputes the steps after its checkpoint sends the same events again, and the store
        keeps them once. (Two events identical in every field at one step are one event.)"""
        self._known_branches(run_id)
        rec = event_record(
            run_id,
            kind,
            step=step,
            branch=branch,
            message=message,
            data=data,
            source=source,
            uid=uid,
        )
        self._put(rec)
        if self.alerts is not None and rec.data["kind"] in ALERT_KINDS:
            self.alerts.notify({"run_id": run_id, **rec.data})
        return str(rec.data["uid"])

    def log_checkpoint(
        self,
        run_id: str,
        *,
        step: int,
        path: str | os.PathLike[str],
        branch: int = 0,
        pinned: bool = False,
        checksum_status: str = "unverified",
    ) -> None:
        """A checkpoint written (or re-pinned, or re-verified: the path is the key)."""
        self._known_branches(run_id)
        rec = checkpoint_record(
            run_id,
            step=step,
            path=str(path),
            branch=branch,
            pinned=pinned,
            checksum_status=checksum_status,
        )
        self._put(rec)

    def set_status(self, run_id: str, status: str) -> None:
        """running | completed | failed | halted | stopped."""
        self._known_branches(run_id)
        self._put(status_record(run_id, status))
        if self.alerts is not None and status == "failed":
            self.alerts.notify({"run_id": run_id, "kind": "failed", "message": "the run failed"})

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything logged so far is in the database; False on timeout."""
        return True

    def persist(self, timeout: float = 10.0) -> None:
        """Make everything logged so far survive a SIGKILL of this process: in the database,
        or (if the database has not taken it within `timeout`) in the spool file."""

    def close(self, timeout: float | None = None) -> None:
        """Write (or spool) what is queued and stop."""
        if self.alerts is not None:
            self.alerts.close(timeout=5.0 if timeout is None else min(timeout, 5.0))

    def __enter__(self) -> BaseSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _known_branches(self, run_id: str) -> set[int]:
        check_run_key(run_id)
        known = self._branches.get(run_id)
        if known is None:
            raise RecordError(f"run {run_id!r} was not started in this sink: call start_run first")
        return known

    def _put(self, rec: Record) -> None:
        raise NotImplementedError


class NullSink(BaseSink):
    """No database: validates like DbSink, then drops the record."""

    def _put(self, rec: Record) -> None:
        pass


class DbSink(BaseSink):
    """Queue + writer thread + spool. See the module docstring."""

    def __init__(
        self,
        url: str | None = None,
        *,
        spool_dir: str | os.PathLike[str],
        queue_size: int = 4096,
        batch_values: int = 1_000_000,
        linger_s: float = 0.2,
        retry_s: tuple[float, float] = (0.5, 10.0),
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.url = resolve_url(url)
        self.batch_values = batch_values
        self.linger_s = linger_s
        self.retry_s = retry_s
        self.stats = {
            "records": 0,
            "values": 0,
            "batches": 0,
            "spooled": 0,
            "overflow": 0,
            "replayed": 0,
        }
        self._q: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._spool = Spool(spool_dir)
        self._writer = Writer(make_engine(self.url, writer=True, **(engine_kwargs or {})))
        self._retry_at = 0.0
        self._backoff = retry_s[0]
        self._waiting: list[threading.Event] = []  # flushes waiting for the spool to drain
        self._inflight: list[Record] | None = None  # the batch being written now
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="spikewatch-sink", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- caller side ----------------------------------------------------------------------

    def _put(self, rec: Record) -> None:
        if self._closed:
            raise RuntimeError("sink is closed")
        try:
            self._q.put_nowait(rec)
        except queue.Full:  # never block the training step: spill to disk
            self._spool.append([rec])
            self.stats["overflow"] += 1

    def flush(self, timeout: float | None = None) -> bool:
        if self._closed:
            return not self._spool.pending()
        done = threading.Event()
        try:
            self._q.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def persist(self, timeout: float = 10.0) -> None:
        if self._closed or self.flush(timeout):
            return
        n = self._spool_queued()
        log.warning(
            "sink: the database has not taken the records within %.1fs; %d kept in the spool "
            "file until it does",
            timeout,
            n,
        )

    def _spool_queued(self) -> int:
        """From the caller's thread, while the writer is stuck in a write: move what is queued
        to the spool file, with a copy of the batch being written (a replay of what did land
        changes nothing). The writer replays the spool before its next batch, so order holds."""
        records: list[Record] = list(self._inflight or ())
        markers: list[Any] = []
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            (records if isinstance(item, Record) else markers).append(item)
        if records:
            self._spill(records)
        for marker in markers:  # flush requests and the stop sentinel, for the writer
            self._q.put(marker)
        return len(records)

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued and stop; after `timeout` seconds with the database still busy,
        what it has not taken is in the spool file (replayed by the next sink on it)."""
        if self._closed:
            return
        super().close(timeout)  # the alerts' last deliveries
        self._closed = True
        atexit.unregister(self.close)
        self._q.put(None)  # blocks only while the queue is full; the writer is draining it
        self._thread.join(timeout)
        if self._thread.is_alive():
            n = self._spool_queued()
            log.error(
                "sink: the database is still busy after %ss; %d records kept in %s",
                timeout,
                n,
                self._spool.dir,
            )
            return
        self._writer.engine.dispose()
        if self._spool.pending():
            log.warning(
                "sink: database %s still unreachable; records kept in %s (replayed by "
                "the next sink on this spool directory)",
                redact(self.url),
                self._spool.dir,
            )

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        self._replay()  # segments left by an earlier process
        while not stop:
            batch, flushes, stop = self._collect()
            try:
                if batch:
                    self._deliver(batch)
                elif self._spool.pending() and time.monotonic() >= self._retry_at:
                    self._replay()
            except Exception:  # the spool itself failed (disk full?): say what is lost, go on
                log.exception(
                    "sink: could not write or spool %d records; they are lost", len(batch)
                )
            self._inflight = None
            self._settle(flushes)
        if self._spool.pending():
            self._retry_at = 0.0
            self._replay()
        self._settle([])

    def _collect(self) -> tuple[list[Record], list[threading.Event], bool]:
        """Block for the first record, then take what arrives within linger_s (or a full batch)."""
        batch: list[Record] = []
        self._inflight = batch  # taken off the queue, not yet in the database
        flushes: list[threading.Event] = []
        size = 0
        deadline = None
        while size < self.batch_values:
            timeout = 0.5 if deadline is None else deadline - time.monotonic()
            try:
                item = (
                    self._q.get(timeout=max(timeout, 0.0)) if timeout > 0 else self._q.get_nowait()
                )
            except queue.Empty:
                break
            if item is None:
                return batch, flushes, True
            if isinstance(item, threading.Event):
                flushes.append(item)
                break  # a flush wants what came before it written now
            batch.append(item)
            size += item.size
            deadline = deadline or time.monotonic() + self.linger_s
        return batch, flushes, False

    def _deliver(self, batch: list[Record]) -> None:
        if self._spool.pending():  # keep order: older spooled records go in first
            if time.monotonic() < self._retry_at or not self._replay():
                self._spill(batch)
                return
        try:
            n = self._writer.write(batch)
        except Exception as e:  # unreachable, locked, schema missing: keep the data, retry
            self._failed(e)
            self._spill(batch)
            return
        self._ok(len(batch), n)

    def _replay(self) -> bool:
        """Write every spool segment, oldest first; True when the spool is empty."""
        for path in self._spool.rotate():
            try:
                for chunk in Spool.read(path, self.batch_values):
                    n = self._writer.write(chunk)
                    self.stats["replayed"] += len(chunk)
                    self._ok(0, n)
            except RecordError as e:
                self._spool.reject(path, str(e))
                continue
            except Exception as e:
                self._failed(e)
                return False
            self._spool.done(path)
            log.info("sink: replayed %s into the database", path.name)
        return True

    def _spill(self, batch: list[Record]) -> None:
        self._spool.append(batch)
        self.stats["spooled"] += len(batch)

    def _ok(self, records: int, values: int) -> None:
        self.stats["records"] += records
        self.stats["values"] += values
        self.stats["batches"] += 1
        self._backoff = self.retry_s[0]

    def _failed(self, e: Exception) -> None:
        log.warning(
            "sink: database write failed (%s: %s); spooling, retry in %.1fs",
            type(e).__name__,
            str(e).splitlines()[0][:200],
            self._backoff,
        )
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.retry_s[1])

    def _settle(self, flushes: list[threading.Event]) -> None:
        """Release flush waiters once nothing is left in the spool."""
        self._waiting.extend(flushes)
        if self._waiting and not self._spool.pending():
            for ev in self._waiting:
                ev.set()
            self._waiting.clear()


def open_run_sink(
    run_dir: str | os.PathLike[str], url: str | None = None, alert_urls: Iterable[str] = ()
) -> BaseSink:
    """The store a run writes to, migrated to the newest schema first: `url`, else
    $SPIKEWATCH_DB_URL, else runs/spikewatch.db in the current directory (`store_url`, the
    file `spikewatch serve` opens from there); url='none' for no store.
    Alerts go to `alert_urls`, else $SPIKEWATCH_ALERT_URLS (observatory/alerts.py)."""
    sink: BaseSink
    if url == "none":
        sink = NullSink()
    else:
        from observatory.store.db import store_url, upgrade

        resolved = store_url(url)
        upgrade(resolved)
        sink = DbSink(resolved, spool_dir=Path(run_dir) / "spool")
    urls = urls_from(alert_urls)
    if urls:
        sink.alerts = Alerter(urls)
    return sink
