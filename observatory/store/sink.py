"""The trainer-side writer: the training step never waits on the database.

Each call is validated on the caller's thread and queued; a writer thread stores batches in
one transaction each, and spools to the run directory (replayed first, later) when the store
is unreachable or the queue is full, so a slow or absent database costs the loop nothing. The
API and its fault rules: docs/store.md, "The sink".
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import text

from spikewatch.observatory.alerts import ALERT_KINDS, Alerter, urls_from
from spikewatch.observatory.store.backlog import Backlog
from spikewatch.observatory.store.db import make_engine, redact, resolve_url
from spikewatch.observatory.store.ingest import Writer
from spikewatch.observatory.store.records import (
    MetricsChecker,
    Record,
    RecordError,
    check_branch,
    check_run_key,
    check_step,
    check_text,
    checkpoint_record,
    event_record,
    heartbeat_record,
    run_record,
    status_record,
)
from spikewatch.observatory.store.spool import Spool

__all__ = ["BaseSink", "DbSink", "NullSink", "RecordError", "open_run_sink"]

log = logging.getLogger(__name__)

REACH_WAIT_S = 10.0  # a resume waits this long at most for the spool before asking the store
PERSIST_MAX_S = 0.1  # the most a checkpoint waits for a store that keeps pace (then: spool)
PERSIST_MIN_S = 0.005
# A store slower than a checkpoint may wait (a busy local SQLite's fsync) takes the records a
# moment later, from the spool: routine, said at DEBUG. Warned of when it is really behind:
# unreachable, or records kept in the spool this long without a write getting through.
BEHIND_WARN_S = 30.0
# A replay after an outage parses and writes the spool in chunks, each followed by a pause as
# long as it took (at most 50 ms): a writer thread that holds the GIL for seconds slows every
# step of the training thread (measured: a 0.2 s step after a 35 s SQLite lock, 0.13 s with
# 50k-value chunks and 5 ms pauses).
REPLAY_CHUNK = 20_000
REPLAY_PAUSE_MAX_S = 0.05


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

    def know_run(self, run_id: str, branches: Iterable[int]) -> None:
        """A run the store holds already, with these branches (a record that comes after the
        run was closed, such as a final evaluation): accept records for it without writing the
        run or its branches again (its status stays)."""
        check_run_key(run_id)
        self._branches.setdefault(run_id, set()).update(check_branch(b) for b in branches)

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

    def reach(self, run_id: str, branch: int, after: int) -> tuple[int | None, int | None]:
        """What the store holds of a run a resume takes over: the last step stored on
        `branch` past `after` (None: nothing past it) and the highest branch number stored
        (None: unknown). A store that cannot say (none, or unreachable) says (None, None)."""
        return None, None

    def heartbeat(self, run_id: str, period_s: float) -> None:
        """The run's process is alive, and says so every `period_s` seconds: a run whose last
        heartbeat is older than two periods and that never ended reads "gone"."""
        self._put(heartbeat_record(run_id, period_s))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything logged so far is in the database; False on timeout."""
        return True

    def persist(self, timeout: float | None = None) -> None:
        """Make everything logged so far survive a SIGKILL of this process: in the database or
        in the spool file, whichever is first (`DbSink.persist`)."""

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
        hold_values: int = 20_000_000,
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
            "lost": 0,
            "lost_values": 0,
        }
        self._spool = Spool(spool_dir)
        self._backlog = Backlog(self._spool, queue_size=queue_size, hold_values=hold_values)
        self._writer = Writer(make_engine(self.url, writer=True, **(engine_kwargs or {})))
        self._retry_at = 0.0
        self._backoff = retry_s[0]
        self._waiting: list[threading.Event] = []  # flushes waiting for the spool to drain
        self._down = False  # the last write failed and none has succeeded since
        self._writing_since: float | None = None  # a write in progress started then
        self._latency: deque[float] = deque(maxlen=32)  # the last writes' durations, seconds
        self._episode_said = False  # persist said once that it spools; again after a success
        self._spooling_since: float | None = None  # the first spool since the last success
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="spikewatch-sink", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- caller side ----------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Records waiting in memory for the writer thread (benchmarks pace themselves by it)."""
        return self._backlog.queued

    def reach(self, run_id: str, branch: int, after: int) -> tuple[int | None, int | None]:
        # what the process before left in the spool goes in first (the replay comes before
        # anything new); a store that does not answer within seconds: unknown
        if not self.flush(timeout=REACH_WAIT_S):
            return None, None
        q = text(
            "SELECT (SELECT MAX(c.last_step) FROM series s JOIN point_windows c "
            "ON c.series_id = s.id WHERE s.run_id = r.id AND s.branch = :branch), "
            "(SELECT MAX(b.number) FROM branches b WHERE b.run_id = r.id) "
            "FROM runs r WHERE r.key = :key"
        )
        try:
            with self._writer.engine.connect() as conn:
                row = conn.execute(q, {"branch": branch, "key": run_id}).first()
        except Exception as e:  # unreachable now: the resume goes on without it
            log.debug("the store's reach of run %s is unknown: %s", run_id, e)
            return None, None
        if row is None:
            return None, None
        last, top = row
        return (int(last) if last is not None and int(last) > after else None), (
            None if top is None else int(top)
        )

    def _put(self, rec: Record) -> None:
        if self._closed:
            raise RuntimeError("sink is closed")
        if not self._backlog.put(rec):  # never block the training step: spill to disk
            self.stats["overflow"] += 1
            self._backlog.spool_all([rec])
            self._sync_stats()

    def flush(self, timeout: float | None = None) -> bool:
        if self._closed:
            return not self._backlog.pending()
        done = threading.Event()
        self._backlog.put(done)
        return done.wait(timeout)

    def wait_bound(self) -> float:
        """How long `persist` waits for a store that is keeping pace: twice its slowest write of
        the last 32 (at least 5 ms); PERSIST_MAX_S before the first write."""
        if not self._latency:
            return PERSIST_MAX_S
        return max(PERSIST_MIN_S, 2.0 * max(self._latency))

    def behind(self) -> str:
        """Why the database cannot take the records now ('' when it can): unreachable, older
        records waiting in the spool, a write running longer than the store's pace allows, or a
        pace slower than a checkpoint may wait."""
        if self._down:
            return "the database is unreachable"
        if self._backlog.pending():
            return "older records wait in the spool"
        bound = self.wait_bound()
        if bound > PERSIST_MAX_S:
            return f"the database's writes take up to {bound / 2:.2f}s"
        since = self._writing_since
        if since is not None and time.monotonic() - since > bound:
            return f"a write has been running for {time.monotonic() - since:.2f}s"
        return ""

    def persist(self, timeout: float | None = None) -> None:
        """Everything logged so far in the database or in the spool file, whichever is first.
        A store that is unreachable or behind is not waited for: the records go to the spool at
        once (milliseconds). A store keeping pace is waited for `wait_bound()`, then spooled.
        With `timeout` (the end of a run), only an unreachable store is not waited for."""
        if self._closed:
            return
        # a caller's own bound (the end of a run) waits for all but an unreachable database
        if timeout is None:
            why = self.behind()
        else:
            why = "the database is unreachable" if self._down else ""
        if not why:
            bound = self.wait_bound() if timeout is None else timeout
            if self.flush(bound):
                return
            why = f"the database has not taken them within {bound:.3f}s"
        n = self._backlog.spool_all()
        self._sync_stats()
        now = time.monotonic()
        if self._spooling_since is None:
            self._spooling_since = now
        behind_s = now - self._spooling_since
        if n or not self._backlog.spool_error:
            if (self._down or behind_s >= BEHIND_WARN_S) and not self._episode_said:
                self._episode_said = True
                late = "" if self._down else f" (no write through for {behind_s:.0f}s)"
                log.warning("sink: %s%s; %d records kept in the spool file in %s until it does",
                            why, late, n, self._spool.dir)  # fmt: skip
            else:
                log.debug("sink: %s; %d records kept in the spool file until it does", why, n)
        else:
            log.error(
                "sink: %s and the spool cannot take records (%s): what is logged is only in "
                "memory until one of them does",
                why,
                self._backlog.spool_error,
            )

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued and stop; after `timeout` seconds with the database still busy,
        what it has not taken is in the spool file (replayed by the next sink on it)."""
        if self._closed:
            return
        super().close(timeout)  # the alerts' last deliveries
        self._closed = True
        atexit.unregister(self.close)
        self._backlog.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            n = self._backlog.spool_all()
            log.error(
                "sink: the database is still busy after %ss; %d records kept in %s",
                timeout,
                n,
                self._spool.dir,
            )
            self._backlog.abandon()
            self._sync_stats()
            return
        self._writer.engine.dispose()
        self._backlog.abandon()
        self._sync_stats()
        if self._spool.pending():
            log.warning(
                "sink: database %s still unreachable; records kept in %s (replayed by "
                "the next sink on this spool directory, `spikewatch db upgrade` or "
                "`spikewatch serve`)",
                redact(self.url),
                self._spool.dir,
            )

    def _sync_stats(self) -> None:
        self.stats["spooled"] = self._backlog.spooled
        self.stats["lost"], self.stats["lost_values"] = self._backlog.lost

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        self._catch_up()  # segments left by an earlier process
        while not stop:
            batch, flushes, stop = self._backlog.take(self.batch_values, self.linger_s)
            try:
                if batch:
                    self._deliver(batch)
                elif self._backlog.pending() and time.monotonic() >= self._retry_at:
                    self._catch_up()
            except Exception:  # a bug: say it, keep the batch where it can be kept, go on
                log.exception("sink: writing %d records failed unexpectedly", len(batch))
                self._backlog.keep(batch)
            self._backlog.done()
            self._sync_stats()
            self._settle(flushes)
        if self._backlog.pending():
            self._retry_at = 0.0
            self._catch_up()
        self._settle([])

    def _deliver(self, batch: list[Record]) -> None:
        if self._backlog.moved():
            return  # a persist put it in the spool: the replay writes it, in order
        if self._backlog.pending():  # keep order: older records go in first
            if time.monotonic() < self._retry_at or not self._catch_up():
                self._backlog.keep(batch)
                return
        try:
            n = self._write(batch)
        except Exception as e:  # unreachable, locked, schema missing: keep the data, retry
            self._failed(e)
            self._backlog.keep(batch)
            return
        self._ok(len(batch), n)

    def _write(self, records: list[Record]) -> int:
        t0 = self._writing_since = time.monotonic()
        try:
            n = self._writer.write(records)
        finally:
            self._writing_since = None
        self._latency.append(time.monotonic() - t0)
        return n

    def _catch_up(self) -> bool:
        """Write the spool's segments, oldest first, then what is held in memory; True when
        nothing older than the queue is left."""
        for path in self._spool.rotate():
            try:
                self._paced(Spool.read(path, min(self.batch_values, REPLAY_CHUNK)))
            except RecordError as e:
                self._spool.reject(path, str(e))
                continue
            except Exception as e:
                self._failed(e)
                return False
            self._spool.done(path)
            log.info("sink: replayed %s into the database", path.name)
        held, gen = self._backlog.held()
        try:
            self._paced(_chunks(held, REPLAY_CHUNK), lambda c: self._backlog.written(len(c), gen))
        except Exception as e:
            self._failed(e)
            return False
        return not self._backlog.pending()

    def _paced(
        self, chunks: Iterable[list[Record]], done: Callable[[list[Record]], object] = len
    ) -> None:
        """Write older records chunk by chunk, each followed by a pause as long as it took: the
        training thread's turn at the GIL."""
        t0 = time.monotonic()
        for chunk in chunks:
            n = self._write(chunk)
            done(chunk)
            self.stats["replayed"] += len(chunk)
            self._ok(0, n)
            time.sleep(min(REPLAY_PAUSE_MAX_S, time.monotonic() - t0))
            t0 = time.monotonic()

    def _ok(self, records: int, values: int) -> None:
        self.stats["records"] += records
        self.stats["values"] += values
        self.stats["batches"] += 1
        self._backoff = self.retry_s[0]
        self._down = self._episode_said = False
        self._spooling_since = None

    def _failed(self, e: Exception) -> None:
        log.warning(
            "sink: database write failed (%s: %s); spooling, retry in %.1fs",
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
            self._backoff,
        )
        self._down = True
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.retry_s[1])

    def _settle(self, flushes: list[threading.Event]) -> None:
        """Release flush waiters once nothing is left in the spool."""
        self._waiting.extend(flushes)
        if self._waiting and not self._backlog.pending():
            for ev in self._waiting:
                ev.set()
            self._waiting.clear()


def _chunks(records: list[Record], values: int) -> Iterator[list[Record]]:
    """`records` in order, in runs of about `values` metric values."""
    chunk: list[Record] = []
    size = 0
    for rec in records:
        chunk.append(rec)
        size += rec.size
        if size >= values:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


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
        from spikewatch.observatory.store.db import store_url, upgrade

        resolved = store_url(url)
        upgrade(resolved)
        sink = DbSink(resolved, spool_dir=Path(run_dir) / "spool")
    urls = urls_from(alert_urls)
    if urls:
        sink.alerts = Alerter(urls)
    return sink
