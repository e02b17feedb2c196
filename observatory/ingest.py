"""The write path: one batch of sink records -> one transaction, idempotent, fast.

Idempotence is by natural keys: runs by `key`, branches by (run, number), series by (run,
metric, branch, layer, head), points by (series, step) with the first value kept, events by the
sender's `uid`, checkpoints by (run, path). Replaying a batch (from the spool, or after a commit
whose acknowledgement was lost) therefore changes nothing.

Points go in bulk, sorted by (series, step) so each series' B-tree grows at its end: `executemany`
on SQLite, a binary `COPY` built by numpy on PostgreSQL. Rollup blocks must count each point
once, so the fast path inserts the batch inside a savepoint with a plain INSERT (no ON CONFLICT:
cheaper); if any key already exists (a replay) it rolls back to the savepoint, stages the batch
in a temporary table, drops the known keys there and inserts only the new points. Block deltas
of the new points are reduced with numpy (observatory/rollup.py) and merged into `point_blocks`
with an upsert that adds counts and keeps the smaller minimum / larger maximum, which is
commutative, so concurrent writers on one series stay exact.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from observatory.models import (
    Branch,
    Checkpoint,
    Event,
    MetricName,
    Run,
    Series,
    utcnow,
)
from observatory.names import MetricKey, parse_name
from observatory.records import Record
from observatory.rollup import Summary, levels

__all__ = ["Writer", "pg_copy_payload"]

log = logging.getLogger(__name__)

_STAGE_DDL = {
    "sqlite": "CREATE TEMP TABLE IF NOT EXISTS sw_stage "
    "(series_id INTEGER, step INTEGER, value REAL)",
    "postgresql": "CREATE TEMP TABLE IF NOT EXISTS sw_stage "
    "(series_id int4, step int4, value float8) ON COMMIT DELETE ROWS",
}
_DELTA_COLS = (
    "series_id, level, block, n, n_nan, nan_step, min_value, min_step, max_value, max_step"
)
_DELTA_DDL = (  # PostgreSQL only: block deltas are COPYed here, then merged in one statement
    "CREATE TEMP TABLE IF NOT EXISTS sw_delta (series_id int4, level int2, block int4, n int4, "
    "n_nan int4, nan_step int4, min_value float8, min_step int4, max_value float8, max_step int4) "
    "ON COMMIT DELETE ROWS"
)
_MERGE_BLOCKS = """
INSERT INTO point_blocks ({cols})
{source}
ON CONFLICT (series_id, level, block) DO UPDATE SET
  n = point_blocks.n + excluded.n,
  n_nan = point_blocks.n_nan + excluded.n_nan,
  nan_step = CASE WHEN point_blocks.nan_step IS NULL OR excluded.nan_step < point_blocks.nan_step
                  THEN excluded.nan_step ELSE point_blocks.nan_step END,
  min_value = CASE WHEN {new_min} THEN excluded.min_value ELSE point_blocks.min_value END,
  min_step = CASE WHEN {new_min} THEN excluded.min_step ELSE point_blocks.min_step END,
  max_value = CASE WHEN {new_max} THEN excluded.max_value ELSE point_blocks.max_value END,
  max_step = CASE WHEN {new_max} THEN excluded.max_step ELSE point_blocks.max_step END
"""
_NEW_MIN = (
    "(excluded.min_value IS NOT NULL AND (point_blocks.min_value IS NULL"
    " OR excluded.min_value < point_blocks.min_value"
    " OR (excluded.min_value = point_blocks.min_value"
    " AND excluded.min_step < point_blocks.min_step)))"
)
_NEW_MAX = _NEW_MIN.replace("min_", "max_").replace(
    " < point_blocks.max_value", " > point_blocks.max_value"
)
MERGE_BLOCKS_SQL = _MERGE_BLOCKS.format(
    cols=_DELTA_COLS,
    source=f"SELECT {_DELTA_COLS} FROM sw_delta WHERE true",
    new_min=_NEW_MIN,
    new_max=_NEW_MAX,
)
MERGE_VALUES_SQL = _MERGE_BLOCKS.format(
    cols=_DELTA_COLS,
    source="VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    new_min=_NEW_MIN,
    new_max=_NEW_MAX,
)
_DEDUPE = {
    "sqlite": (
        "DELETE FROM sw_stage WHERE rowid NOT IN "
        "(SELECT MIN(rowid) FROM sw_stage GROUP BY series_id, step)",
        "DELETE FROM sw_stage WHERE EXISTS (SELECT 1 FROM points AS p "
        "WHERE p.series_id = sw_stage.series_id AND p.step = sw_stage.step)",
    ),
    "postgresql": (
        "DELETE FROM sw_stage AS a USING sw_stage AS b WHERE a.series_id = b.series_id "
        "AND a.step = b.step AND a.ctid > b.ctid",
        "DELETE FROM sw_stage AS s USING points AS p "
        "WHERE p.series_id = s.series_id AND p.step = s.step",
    ),
}


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

    def write(self, records: Sequence[Record]) -> int:
        """Write `records` in one transaction; return the number of metric values sent."""
        try:
            with self.engine.begin() as conn:
                return self._write(conn, records)
        except BaseException:
            self.forget()  # ids learnt in the failed transaction may not exist
            raise

    def forget(self) -> None:
        """Drop every cached id (they are looked up again on the next batch)."""
        self._runs.clear()
        self._metrics.clear()
        self._series.clear()
        self._branches.clear()
        self._layouts.clear()

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
                order = np.argsort(steps, kind="stable")
                sids = np.full(len(steps), sid, np.int64)
                self._write_points(conn, sids, steps[order], values[order])
        except BaseException:
            self.forget()
            raise
        return len(steps)

    def _write(self, conn: Connection, records: Sequence[Record]) -> int:
        metrics = []
        for rec in records:
            if rec.kind == "metrics":
                metrics.append(rec)
            else:
                self._write_control(conn, rec)
        if not metrics:
            return 0
        sid, step, value = self._arrays(conn, metrics)
        self._write_points(conn, sid, step, value)
        return len(sid)

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
        now = utcnow()
        ended = now if data["status"] != "running" else None
        stmt = update(Run).where(Run.id == run_id)
        conn.execute(stmt.values(status=data["status"], updated_at=now, ended_at=ended))

    def _on_event(self, conn: Connection, run_key: str, data: Mapping[str, Any]) -> None:
        run_id = self._run_id(conn, run_key)
        ins = self._insert(Event).values(run_id=run_id, created_at=utcnow(), **data)
        conn.execute(ins.on_conflict_do_nothing(index_elements=["uid"]))

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

    def _arrays(self, conn: Connection, metrics: list[Record]) -> tuple[np.ndarray, ...]:
        """(series id, step, value) arrays of a batch, sorted by (series id, step), stable."""
        sids, counts, steps, vals = [], [], [], []
        for rec in metrics:
            run_id = self._run_id(conn, rec.run)
            branch, values = rec.data["branch"], rec.data["values"]
            names = list(values)
            layout = self._layouts.get((run_id, branch))
            if layout is None or layout[0] != names:  # same names as last step: no lookups
                ids = self._series_ids(conn, run_id, branch, set(names))
                layout = (names, np.fromiter((ids[n] for n in names), np.int64, len(names)))
                self._layouts[(run_id, branch)] = layout
            sids.append(layout[1])
            counts.append(len(names))
            steps.append(rec.data["step"])
            vals.append(np.fromiter(values.values(), np.float64, len(names)))
        sid = np.concatenate(sids)
        step = np.repeat(np.asarray(steps, np.int64), counts)
        value = np.concatenate(vals)
        order = np.lexsort((step, sid))
        return sid[order], step[order], value[order]

    def _write_points(
        self, conn: Connection, sid: np.ndarray, step: np.ndarray, value: np.ndarray
    ) -> None:
        try:  # fast path: every key is new (a plain INSERT, no staging)
            with conn.begin_nested():
                self._copy(conn, "points", sid, step, value)
        except (IntegrityError, self._dbapi_integrity):  # a replay: store only the new keys
            sid, step, value = self._insert_new(conn, sid, step, value)
        if len(sid):
            self._merge_blocks(conn, Summary.of_points(sid, step, value))

    def _insert_new(
        self, conn: Connection, sid: np.ndarray, step: np.ndarray, value: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        conn.exec_driver_sql(_STAGE_DDL[self.dialect])
        conn.exec_driver_sql("DELETE FROM sw_stage")
        self._copy(conn, "sw_stage", sid, step, value)
        for sql in _DEDUPE[self.dialect]:
            conn.exec_driver_sql(sql)
        rows = conn.exec_driver_sql(
            "SELECT series_id, step, value FROM sw_stage ORDER BY series_id, step"
        ).all()
        conn.exec_driver_sql(
            "INSERT INTO points (series_id, step, value) "
            "SELECT series_id, step, value FROM sw_stage"
        )
        conn.exec_driver_sql("DELETE FROM sw_stage")
        log.info("replay: %d of %d points were new", len(rows), len(sid))
        if not rows:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0)
        s, t, v = zip(*rows, strict=True)
        return (
            np.asarray(s, np.int64),
            np.asarray(t, np.int64),
            np.asarray([math.nan if x is None else x for x in v], np.float64),
        )

    def _copy(
        self, conn: Connection, table: str, sid: np.ndarray, step: np.ndarray, value: np.ndarray
    ) -> None:
        """Bulk insert: executemany on SQLite (NaN binds as NULL), binary COPY on PostgreSQL."""
        if self.dialect == "sqlite":
            cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            try:
                cur.executemany(
                    f"INSERT INTO {table} VALUES (?, ?, ?)",
                    zip(sid.tolist(), step.tolist(), value.tolist(), strict=True),
                )
            finally:
                cur.close()
            return
        pg = conn.connection.driver_connection
        with pg.cursor() as cur:  # type: ignore[union-attr]
            with cur.copy(
                f"COPY {table} (series_id, step, value) FROM STDIN (FORMAT BINARY)"
            ) as cp:
                cp.write(pg_copy_payload(sid, step, value))

    def _merge_blocks(self, conn: Connection, points: Summary) -> None:
        merge = text(MERGE_BLOCKS_SQL)
        for level, delta in levels(points):
            rows = delta.rows(level)
            if self.dialect == "sqlite":
                cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
                try:
                    cur.executemany(MERGE_VALUES_SQL, rows)
                finally:
                    cur.close()
                continue
            conn.exec_driver_sql(_DELTA_DDL)
            pg = conn.connection.driver_connection
            with pg.cursor() as cur:  # type: ignore[union-attr]
                with cur.copy(f"COPY sw_delta ({_DELTA_COLS}) FROM STDIN") as cp:
                    for row in rows:
                        cp.write_row(row)
            conn.execute(merge)
            conn.exec_driver_sql("DELETE FROM sw_delta")


_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_COPY_ROW = np.dtype(
    [
        ("nf", ">i2"),
        ("l1", ">i4"),
        ("sid", ">i4"),
        ("l2", ">i4"),
        ("step", ">i4"),
        ("l3", ">i4"),
        ("value", ">f8"),
    ]
)


def pg_copy_payload(sid: np.ndarray, step: np.ndarray, value: np.ndarray) -> bytes:
    """PostgreSQL binary COPY rows (int4, int4, float8) built by numpy; NaN becomes NULL."""
    nan = np.isnan(value)
    ok = ~nan
    rows = np.empty(int(ok.sum()), _COPY_ROW)
    rows["nf"], rows["l1"], rows["l2"], rows["l3"] = 3, 4, 4, 8
    rows["sid"], rows["step"], rows["value"] = sid[ok], step[ok], value[ok]
    nulls = b"".join(
        struct.pack(">hii ii i", 3, 4, s, 4, t, -1)
        for s, t in zip(sid[nan].tolist(), step[nan].tolist(), strict=True)
    )
    return _COPY_HEADER + rows.tobytes() + nulls + struct.pack(">h", -1)
