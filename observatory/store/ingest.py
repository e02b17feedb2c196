"""The write path: one batch of sink records -> one transaction, idempotent, fast.

Idempotence is by natural keys: runs by `key`, branches by (run, number), series by (run,
metric, branch, layer, head), values by (series, step) with the first value kept, events by the
sender's `uid`, checkpoints by (run, path). Replaying a batch (from the spool, or after a commit
whose acknowledgement was lost) therefore changes nothing.

Values are stored per series and window of steps (observatory/store/chunks.py). A batch's values are
gathered per series with numpy (a step's record is a row of a steps x series matrix), split at
window edges, merged with what the window already holds (first value kept) and written as whole
window rows: an INSERT for a new window, an UPDATE for one that grows. The writer remembers the
last window it wrote of each series, so a growing window is not read back; the UPDATE is guarded
by the stored count, and a window some other writer changed meanwhile fails the batch, which is
then retried once with everything read from the database.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite

from spikewatch.observatory.store.chunks import ROW_COLUMNS, SUMMARY_COLUMNS, WINDOW, decode, encode
from spikewatch.observatory.store.models import (
    Branch,
    Checkpoint,
    Event,
    MetricName,
    Run,
    Sample,
    Series,
    utcnow,
)
from spikewatch.observatory.store.names import MetricKey, parse_name
from spikewatch.observatory.store.records import Record, sample_row

__all__ = ["StaleWindowError", "Writer"]

log = logging.getLogger(__name__)

MAIN, TAIL = "point_chunks", "point_tails"  # windows moved past; each series' newest
_COLS = ", ".join(ROW_COLUMNS)
_SET = ", ".join(f"{c} = ?" for c in (*SUMMARY_COLUMNS, "steps", "vals"))
INSERT_SQL = f"INSERT INTO {{table}} ({_COLS}) VALUES ({', '.join('?' * len(ROW_COLUMNS))})"
UPDATE_MAIN = f"UPDATE {MAIN} SET {_SET} WHERE series_id = ? AND win = ? AND n = ?"
UPDATE_TAIL = f"UPDATE {TAIL} SET win = ?, {_SET} WHERE series_id = ? AND win = ? AND n = ?"
MOVE_SQL = f"INSERT INTO {MAIN} ({_COLS}) SELECT {_COLS} FROM {TAIL} WHERE series_id IN ({{ids}})"
Piece = tuple[np.ndarray, np.ndarray]  # steps (ascending, unique), values


class StaleWindowError(RuntimeError):
    """A window changed under the writer (another writer on the same series)."""


class Writer:
    """Writes batches of records to one database. Not thread-safe: one per writer thread.

    Ids are cached; a failed transaction clears the cache, so a rolled-back batch never leaves
    it pointing at rows that do not exist.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        self._dbapi_integrity = engine.dialect.loaded_dbapi.IntegrityError
        self._runs: dict[str, int] = {}
        self._metrics: dict[str, int] = {}
        self._series: dict[tuple[int, int, str], int] = {}
        self._branches: set[tuple[int, int]] = set()
        self._layouts: dict[tuple[int, int], tuple[list[str], np.ndarray]] = {}
        # series -> its tail row's (window, count) and, when this writer wrote it, its content
        self._tail: dict[int, tuple[int, int, np.ndarray | None, np.ndarray | None]] = {}
        self._top: dict[int, int] = {}  # sid -> highest stored window (-1: none)
        self._mark = "%s" if self.dialect == "postgresql" else "?"

    def write(self, records: Sequence[Record]) -> int:
        """Write `records` in one transaction; return the number of metric values sent."""
        for attempt in (1, 2):
            try:
                with self.engine.begin() as conn:
                    return self._write(conn, records)
            except StaleWindowError:
                self.forget()
                if attempt == 2:
                    raise
                log.info("a window changed under this writer; writing the batch again")
            except BaseException:
                self.forget()  # ids and windows learnt in the failed transaction may not exist
                raise
        raise AssertionError("unreachable")

    def forget(self) -> None:
        """Drop every cached id (they are looked up again on the next batch)."""
        self._runs.clear()
        self._metrics.clear()
        self._series.clear()
        self._branches.clear()
        self._layouts.clear()
        self._tail.clear()
        self._top.clear()

    def write_series(
        self, run_key: str, branch: int, metric: str, steps: np.ndarray, values: np.ndarray
    ) -> int:
        """Bulk-load one metric's points (an import, a benchmark) in one transaction.

        Run and branch are created if needed. Same idempotence as `write`.
        """
        steps = np.asarray(steps, np.int64)
        values = np.asarray(values, np.float64)
        if steps.shape != values.shape or steps.ndim != 1:
            raise ValueError(
                f"steps and values must be 1-D of one length: {steps.shape} {values.shape}"
            )
        if len(steps) and (steps.min() < 0 or steps.max() > 2**31 - 1):
            raise ValueError("steps must be in [0, 2**31 - 1]")
        try:
            with self.engine.begin() as conn:
                run_id = self._run_id(conn, run_key)
                sid = self._series_ids(conn, run_id, branch, {metric})[metric]
                self._write_points(conn, {sid: _unique(steps, values)})
        except BaseException:
            self.forget()
            raise
        return len(steps)

    def _write(self, conn: Connection, records: Sequence[Record]) -> int:
        metrics = []
        for rec in records:
            if rec.kind in ("metrics", "series"):
                metrics.append(rec)
            else:
                self._write_control(conn, rec)
        if not metrics:
            return 0
        pieces, n = self._pieces(conn, metrics)
        self._write_points(conn, pieces)
        return n

    # -- control records ------------------------------------------------------------------

    def _write_control(self, conn: Connection, rec: Record) -> None:
        handler = getattr(self, f"_on_{rec.kind}", None)
        if handler is None:
            raise ValueError(f"unknown record kind {rec.kind!r}")
        handler(conn, rec.run, rec.data)

    def _on_run(self, conn: Connection, run_key: str, data: Mapping[str, Any]) -> None:
        now = utcnow()
        values = {"key": run_key, "created_at": now, "updated_at": now, **data}
        ins = self._insert(Run).values(**values)
        fields = {k: ins.excluded[k] for k in (*data.keys(), "updated_at")}
        conn.execute(ins.on_conflict_do_update(index_elements=["key"], set_=fields))
        self._ensure_branch(conn, self._run_id(conn, run_key), 0)

    def _on_branch(self, conn: Connection, run_key: str, data: Mapping[str, Any]) -> None:
        run_id = self._run_id(conn, run_key)
        ins = self._insert(Branch).values(run_id=run_id, created_at=utcnow(), **data)
        fields = {k: ins.excluded[k] for k in ("parent", "fork_step", "reason")}
        conn.execute(ins.on_conflict_do_update(index_elements=["run_id", "number"], set_=fields))
        self._branches.add((run_id, data["number"]))

    def _on_status(self, conn: Connection, run_key: str, data: Mapping[str, Any]) -> None:
        run_id = self._run_id(conn, run_key)
        if data["status"] != "running" and self.dialect == "postgresql":
            # nothing grows any more: the tails join the other windows, and the tail table's
            # old row versions become reusable (SQLite rewrites rows in place: nothing to do)
            series = f"SELECT id FROM series WHERE run_id = {int(run_id)}"
            conn.exec_driver_sql(MOVE_SQL.format(ids=series))
            conn.exec_driver_sql(f"DELETE FROM {TAIL} WHERE series_id IN ({series})")
            self._tail.clear()
            self._top.clear()
        now = utcnow()
        ended = now if data["status"] != "running" else None
        stmt = update(Run).where(Run.id == run_id)
        conn.execute(stmt.values(status=data["status"], updated_at=now, ended_at=ended))

    def _on_heartbeat(self, conn: Connection, run_key: str, data: Mapping[str, Any]) -> None:
        at = datetime.fromtimestamp(float(data["at"]), UTC)
        stmt = update(Run).where(Run.key == run_key)
        conn.execute(stmt.values(heartbeat_at=at, heartbeat_s=float(data["period_s"])))

    def _on_event(self, conn: Connection, run_key: str, data: Mapping[str, Any]) -> None:
        run_id = self._run_id(conn, run_key)
        ins = self._insert(Event).values(run_id=run_id, created_at=utcnow(), **data)
        conn.execute(ins.on_conflict_do_nothing(index_elements=["uid"]))
        named = (data.get("data") or {}).get("samples") if data.get("kind") == "rollback" else None
        if named:  # the rows the rollback named, as rows of their own (same transaction)
            rows = [sample_row(run_id, data, s) for s in named]
            ins = self._insert(Sample).values(rows)
            conn.execute(ins.on_conflict_do_nothing(index_elements=["event_uid", "batch", "row"]))

    def _on_checkpoint(self, conn: Connection, run_key: str, data: Mapping[str, Any]) -> None:
        run_id = self._run_id(conn, run_key)
        ins = self._insert(Checkpoint).values(run_id=run_id, created_at=utcnow(), **data)
        fields = {k: ins.excluded[k] for k in ("branch", "step", "pinned", "checksum_status")}
        conn.execute(ins.on_conflict_do_update(index_elements=["run_id", "path"], set_=fields))

    # -- ids ------------------------------------------------------------------------------

    def _insert(self, model: Any) -> Any:
        dialect_insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        return dialect_insert(model)

    def _run_id(self, conn: Connection, run_key: str) -> int:
        """The run's id; a run first seen through its metrics is created bare.

        That happens when records arrive out of order (a full queue spilled a step to the spool
        before the run's own record was written); the run record fills the fields in later.
        """
        if (rid := self._runs.get(run_key)) is not None:
            return rid
        rid = conn.execute(select(Run.id).where(Run.key == run_key)).scalar()
        if rid is None:
            now = utcnow()
            ins = self._insert(Run).values(
                key=run_key, status="running", config={}, tags=[], created_at=now, updated_at=now
            )
            conn.execute(ins.on_conflict_do_nothing(index_elements=["key"]))
            rid = conn.execute(select(Run.id).where(Run.key == run_key)).scalar_one()
            self._ensure_branch(conn, rid, 0)
        self._runs[run_key] = rid
        return rid

    def _ensure_branch(self, conn: Connection, run_id: int, number: int) -> None:
        if (run_id, number) in self._branches:
            return
        ins = self._insert(Branch).values(run_id=run_id, number=number, created_at=utcnow())
        conn.execute(ins.on_conflict_do_nothing(index_elements=["run_id", "number"]))
        self._branches.add((run_id, number))

    def _metric_ids(self, conn: Connection, names: Iterable[str]) -> dict[str, int]:
        missing = sorted({n for n in names if n not in self._metrics})
        found = {n: self._metrics[n] for n in names if n in self._metrics}
        if missing:
            ins = self._insert(MetricName).values([{"name": n} for n in missing])
            conn.execute(ins.on_conflict_do_nothing(index_elements=["name"]))
            rows = conn.execute(
                select(MetricName.name, MetricName.id).where(MetricName.name.in_(missing))
            )
            for name, mid in rows:
                found[name] = mid
                self._metrics[name] = mid
        return found

    def _series_ids(
        self, conn: Connection, run_id: int, branch: int, names: set[str]
    ) -> dict[str, int]:
        """Series id per flat metric name, creating series (and the branch) as needed."""
        out: dict[str, int] = {}
        missing: dict[str, MetricKey] = {}
        for name in names:
            sid = self._series.get((run_id, branch, name))
            if sid is None:
                missing[name] = parse_name(name)
            else:
                out[name] = sid
        if missing:
            self._ensure_branch(conn, run_id, branch)
            out.update(self._create_series(conn, run_id, branch, missing))
        return out

    def _create_series(
        self, conn: Connection, run_id: int, branch: int, keys: dict[str, MetricKey]
    ) -> dict[str, int]:
        mids = self._metric_ids(conn, {k.template for k in keys.values()})
        wanted = [
            {
                "run_id": run_id,
                "branch": branch,
                "metric_id": mids[k.template],
                "layer": k.layer,
                "head": k.head,
            }
            for k in keys.values()
        ]
        ins = self._insert(Series).values(wanted)
        conn.execute(
            ins.on_conflict_do_nothing(
                index_elements=["run_id", "metric_id", "branch", "layer", "head"]
            )
        )
        q = select(Series.id, Series.metric_id, Series.layer, Series.head).where(
            Series.run_id == run_id,
            Series.branch == branch,
            Series.metric_id.in_(set(mids.values())),
        )
        by_key = {(m, layer, head): sid for sid, m, layer, head in conn.execute(q)}
        out = {}
        for name, k in keys.items():
            sid = by_key[(mids[k.template], k.layer, k.head)]
            out[name] = sid
            self._series[(run_id, branch, name)] = sid
        return out

    # -- points ---------------------------------------------------------------------------

    def _pieces(self, conn: Connection, metrics: list[Record]) -> tuple[dict[int, Piece], int]:
        """{series id: (steps, values)} of a batch and the number of values sent.

        A series record (many steps of each metric, an import) is one piece per metric. Other
        records with one layout (run, branch and the same names as the step before: the usual
        case) are stacked as a steps x series matrix, so the per-value work is numpy's."""
        groups: dict[int, tuple[np.ndarray, list[int], list[np.ndarray]]] = {}
        sent = 0
        parts: dict[int, list[Piece]] = {}
        for rec in metrics:
            run_id = self._run_id(conn, rec.run)
            if rec.kind == "series":  # columns already: one piece per metric
                columns = rec.data["series"]
                ids = self._series_ids(conn, run_id, rec.data["branch"], set(columns))
                for name, (steps, values) in columns.items():
                    if len(steps):
                        st, v = np.asarray(steps, np.int64), np.asarray(values, np.float64)
                        parts.setdefault(ids[name], []).append(_unique(st, v))
                        sent += len(st)
                continue
            branch, values = rec.data["branch"], rec.data["values"]
            names = list(values)
            layout = self._layouts.get((run_id, branch))
            if layout is None or layout[0] != names:  # same names as last step: no lookups
                ids = self._series_ids(conn, run_id, branch, set(names))
                layout = (names, np.fromiter((ids[n] for n in names), np.int64, len(names)))
                self._layouts[(run_id, branch)] = layout
            group = groups.setdefault(id(layout[1]), (layout[1], [], []))
            group[1].append(rec.data["step"])
            group[2].append(np.fromiter(values.values(), np.float64, len(names)))
            sent += len(names)
        for sids, steps, rows in groups.values():
            st = np.asarray(steps, np.int64)
            order = np.argsort(st, kind="stable")
            st, first = np.unique(st[order], return_index=True)  # a step twice: the first
            matrix = np.stack(rows)[order[first]].T.copy()
            for sid, column in zip(sids.tolist(), matrix, strict=True):
                parts.setdefault(sid, []).append((st, column))
        pieces = {
            sid: ps[0] if len(ps) == 1 else _unique(*map(np.concatenate, zip(*ps, strict=True)))
            for sid, ps in parts.items()
        }
        return pieces, sent

    def _write_points(self, conn: Connection, pieces: dict[int, Piece]) -> None:
        """Merge each series' new values into its windows and write the changed windows.

        A series' newest window is its row in the tail table, updated in place; when a batch
        starts a later window, the tail's window is inserted into the main table (merged with
        the batch's values for it, or copied as it is) and the row takes the new window."""
        self._learn(conn, [sid for sid in pieces if sid not in self._top])
        splits = {sid: list(_by_window(*piece)) for sid, piece in pieces.items()}
        stored = self._read_windows(
            conn,
            [
                (sid, w)
                for sid, parts in splits.items()
                for w, _, _ in parts
                if w <= self._top[sid] and self._cached(sid, w) is None
            ],
        )
        moves: list[int] = []
        writes: dict[str, list[tuple[Any, ...]]] = {}
        for sid, parts in splits.items():
            tail, newest = self._tail.get(sid), max(self._top[sid], parts[-1][0])
            if tail is not None and tail[0] < newest and tail[0] not in {w for w, _, _ in parts}:
                moves.append(sid)  # the tail's window, untouched by this batch, as it is
            for w, st, v in parts:
                old = self._cached(sid, w) or stored.get((sid, w))
                if old is not None:
                    st, v = _merge(old[1], old[2], st, v)
                    if len(st) == len(old[1]) and not (old[0] == TAIL and w < newest):
                        continue  # every value was there already (a replay)
                row = encode(sid, st, v)
                if w == newest and not (old is not None and old[0] == MAIN):
                    if tail is None:
                        writes.setdefault(INSERT_SQL.format(table=TAIL), []).append(row)
                    else:
                        guard = (sid, tail[0], tail[1])
                        writes.setdefault(UPDATE_TAIL, []).append((*row[1:], *guard))
                    self._tail[sid] = (w, len(st), st, v)
                elif old is None or old[0] == TAIL:
                    writes.setdefault(INSERT_SQL.format(table=MAIN), []).append(row)
                else:
                    writes.setdefault(UPDATE_MAIN, []).append((*row[2:], sid, w, len(old[1])))
            self._top[sid] = newest
        for chunk in _chunked(moves, 5_000):
            conn.exec_driver_sql(MOVE_SQL.format(ids=", ".join(map(str, chunk))))
        for sql in sorted(writes, key=lambda q: q.startswith("UPDATE")):  # inserts first
            rows = writes[sql]
            if self._execute(conn, sql, rows) != len(rows):
                raise StaleWindowError("a stored window changed while this batch was written")

    def _cached(self, sid: int, w: int) -> tuple[str, np.ndarray, np.ndarray] | None:
        """(table, steps, values) of a series' tail window, as this writer last wrote it."""
        tail = self._tail.get(sid)
        if tail is None or tail[0] != w or tail[2] is None or tail[3] is None:
            return None
        return TAIL, tail[2], tail[3]

    def _learn(self, conn: Connection, sids: list[int]) -> None:
        """Each series' highest stored window and its tail row's (window, count)."""
        if not sids:
            return
        tops: dict[int, int] = {}
        for chunk in _chunked(sids, 5_000):
            ids = ", ".join(map(str, chunk))
            q = f"SELECT series_id, MAX(win) FROM {MAIN} WHERE series_id IN ({ids}) "
            tops.update({sid: w for sid, w in conn.exec_driver_sql(q + "GROUP BY series_id")})
            q = f"SELECT series_id, win, n FROM {TAIL} WHERE series_id IN ({ids})"
            for sid, win, n in conn.exec_driver_sql(q):
                self._tail[sid] = (win, n, None, None)
                tops[sid] = max(tops.get(sid, -1), win)
        for sid in sids:
            self._top[sid] = tops.get(sid, -1)

    def _read_windows(
        self, conn: Connection, keys: list[tuple[int, int]]
    ) -> dict[tuple[int, int], tuple[str, np.ndarray, np.ndarray]]:
        """Stored windows (a replay, a resume, another process's series), decoded, with the
        table each is in."""
        out = {}
        by_win: dict[int, list[int]] = {}
        for sid, w in keys:
            by_win.setdefault(w, []).append(sid)
        for w, sids in by_win.items():
            for chunk in _chunked(sids, 5_000):
                where = f"win = {int(w)} AND series_id IN ({', '.join(map(str, chunk))})"
                q = " UNION ALL ".join(
                    f"SELECT '{table}', series_id, win, first_step, last_step, n, steps, vals "
                    f"FROM {table} WHERE {where}"
                    for table in (MAIN, TAIL)
                )
                for table, sid, win, first, last, n, steps, vals in conn.exec_driver_sql(q):
                    st, v = decode(win, first, last, n, steps, vals)
                    out[sid, win] = (table, st, v)
        return out

    def _execute(self, conn: Connection, sql: str, rows: list[tuple[Any, ...]]) -> int:
        """executemany on the driver's cursor; the number of rows changed."""
        if not rows:
            return 0
        cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            cur.executemany(sql.replace("?", self._mark), rows)
            return int(cur.rowcount)
        finally:
            cur.close()


def _chunked(xs: list[int], size: int) -> Iterable[list[int]]:
    for i in range(0, len(xs), size):
        yield xs[i : i + size]


def _unique(steps: np.ndarray, values: np.ndarray) -> Piece:
    """Sorted by step; a step given twice keeps its first value."""
    if len(steps) < 2 or (np.diff(steps) > 0).all():
        return np.ascontiguousarray(steps, np.int64), np.ascontiguousarray(values, np.float64)
    order = np.argsort(steps, kind="stable")
    st, first = np.unique(np.asarray(steps, np.int64)[order], return_index=True)
    return st, np.asarray(values, np.float64)[order][first]


def _by_window(
    steps: np.ndarray, values: np.ndarray
) -> Iterable[tuple[int, np.ndarray, np.ndarray]]:
    win = steps // WINDOW
    if win[0] == win[-1]:
        yield int(win[0]), steps, values
        return
    cuts = np.flatnonzero(np.diff(win)) + 1
    for st, v in zip(np.split(steps, cuts), np.split(values, cuts), strict=True):
        yield int(st[0] // WINDOW), st, v


def _merge(old_st: np.ndarray, old_v: np.ndarray, st: np.ndarray, v: np.ndarray) -> Piece:
    """A stored window and new values: the stored value wins where a step is in both."""
    if st[0] > old_st[-1]:
        return np.concatenate((old_st, st)), np.concatenate((old_v, v))
    new = ~np.isin(st, old_st)
    return _unique(np.concatenate((old_st, st[new])), np.concatenate((old_v, v[new])))
