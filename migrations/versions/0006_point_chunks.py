"""Values packed per series and 512-step window instead of one row per value.

At a 70B model's shape (80 layers x 64 heads, every step) one row per value cost about 20 bytes
per value on SQLite before its rollup blocks, and ingest topped out near 370k values/s; a window
row costs about 3.5 bytes per value and is written at well over 1M values/s
(benchmarks/store_scale.py). The window's exact summary (count, NaNs, min and max with their
steps) replaces the `point_blocks` rollups.

Windows a series has moved past go to `point_chunks` and are never updated; each series' newest
window lives in its one row of `point_tails` while it grows; the view `point_windows` reads
both. Upgrade converts every stored value (into `point_chunks`: nothing of an old database is
still growing), exactly, in series order; downgrade unpacks them back into
`points` and rebuilds the four rollup levels in SQL (ties to the earliest step, as before).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

from spikewatch.observatory.store.chunks import ROW_COLUMNS, WINDOW, decode, encode

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_LEVELS = {1: 16, 2: 64, 3: 256, 4: 4096}
_BATCH = 2_000


def _create_windows() -> None:
    for table in ("point_chunks", "point_tails"):
        _create_window_table(table)
    cols = ", ".join(ROW_COLUMNS)
    op.execute(
        f"CREATE VIEW point_windows AS SELECT {cols} FROM point_chunks "
        f"UNION ALL SELECT {cols} FROM point_tails"
    )


def _create_window_table(name: str) -> None:
    op.create_table(
        name,
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("win", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.Integer(), nullable=False),
        sa.Column("last_step", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("n_nan", sa.Integer(), nullable=False),
        sa.Column("nan_step", sa.Integer(), nullable=True),
        sa.Column("min_value", sa.Double(), nullable=True),
        sa.Column("min_step", sa.Integer(), nullable=True),
        sa.Column("max_value", sa.Double(), nullable=True),
        sa.Column("max_step", sa.Integer(), nullable=True),
        sa.Column("steps", sa.LargeBinary(), nullable=True),
        sa.Column("vals", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint(
            *(("series_id", "win") if name == "point_chunks" else ("series_id",)),
            name=op.f(f"pk_{name}"),
        ),
    )
    if op.get_bind().dialect.name == "postgresql":  # already compressed: keep it in the row
        op.execute(f"ALTER TABLE {name} ALTER COLUMN vals SET STORAGE MAIN")
        op.execute(f"ALTER TABLE {name} ALTER COLUMN steps SET STORAGE MAIN")
        if name == "point_tails":  # room on each page for a row's next version (HOT update)
            op.execute(f"ALTER TABLE {name} SET (fillfactor = 50)")


def _windows(rows: Iterator[tuple[int, int, float | None]]) -> Iterator[tuple[object, ...]]:
    """Encoded window rows from (series, step, value) rows in (series, step) order."""
    key, steps, vals = None, [], []
    for sid, step, value in rows:
        k = (sid, step // WINDOW)
        if k != key and steps:
            yield encode(key[0], np.asarray(steps, np.int64), np.asarray(vals, np.float64))
            steps, vals = [], []
        key = k
        steps.append(step)
        vals.append(math.nan if value is None else value)
    if steps:
        yield encode(key[0], np.asarray(steps, np.int64), np.asarray(vals, np.float64))


def upgrade() -> None:
    _create_windows()
    conn = op.get_bind()
    table = sa.table("point_chunks", *(sa.column(c) for c in ROW_COLUMNS))
    result = conn.execute(
        sa.text(
            "SELECT series_id, step, value FROM points ORDER BY series_id, step"
        ).execution_options(yield_per=50_000)
    )
    batch: list[dict[str, object]] = []
    for row in _windows(iter(result)):
        batch.append(dict(zip(ROW_COLUMNS, row, strict=True)))
        if len(batch) >= _BATCH:
            conn.execute(table.insert(), batch)
            batch = []
    result.close()
    if batch:
        conn.execute(table.insert(), batch)
    op.drop_table("point_blocks")
    op.drop_table("points")


def _reduce(level: int, size: int) -> str:
    """INSERT of one rollup level from `points`; extremes' ties to the earliest step."""
    g = f"step / {size}"
    first = (
        "SELECT series_id, g, {value}, {step} FROM ("
        f"SELECT series_id, {g} AS g, value AS {{value}}, step AS {{step}}, ROW_NUMBER() OVER "
        f"(PARTITION BY series_id, {g} ORDER BY value {{order}}, step) AS rn "
        "FROM points WHERE value IS NOT NULL) AS ranked WHERE rn = 1"
    )
    mn = first.format(value="min_value", step="min_step", order="ASC")
    mx = first.format(value="max_value", step="max_step", order="DESC")
    return f"""
INSERT INTO point_blocks
  (series_id, level, block, n, n_nan, nan_step, min_value, min_step, max_value, max_step)
SELECT a.series_id, {level}, a.g, a.n, a.n_nan, a.nan_step,
       mn.min_value, mn.min_step, mx.max_value, mx.max_step
FROM (SELECT series_id, {g} AS g, COUNT(*) AS n, COUNT(*) - COUNT(value) AS n_nan,
             MIN(CASE WHEN value IS NULL THEN step END) AS nan_step
      FROM points GROUP BY series_id, {g}) AS a
LEFT JOIN ({mn}) AS mn ON mn.series_id = a.series_id AND mn.g = a.g
LEFT JOIN ({mx}) AS mx ON mx.series_id = a.series_id AND mx.g = a.g"""


def downgrade() -> None:
    op.create_table(
        "point_blocks",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("level", sa.SmallInteger(), nullable=False),
        sa.Column("block", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("n_nan", sa.Integer(), nullable=False),
        sa.Column("nan_step", sa.Integer(), nullable=True),
        sa.Column("min_value", sa.Double(), nullable=True),
        sa.Column("min_step", sa.Integer(), nullable=True),
        sa.Column("max_value", sa.Double(), nullable=True),
        sa.Column("max_step", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("series_id", "level", "block", name=op.f("pk_point_blocks")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "points",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("series_id", "step", name=op.f("pk_points")),
        sqlite_with_rowid=False,
    )
    conn = op.get_bind()
    points = sa.table("points", sa.column("series_id"), sa.column("step"), sa.column("value"))
    result = conn.execute(
        sa.text(
            "SELECT series_id, win, first_step, last_step, n, steps, vals FROM point_windows "
            "ORDER BY series_id, win"
        ).execution_options(yield_per=1_000)
    )
    for rows in result.partitions():
        batch = []
        for sid, win, first, last, n, steps, vals in rows:
            st, v = decode(win, first, last, n, steps, vals)
            batch += [
                {"series_id": sid, "step": s, "value": None if math.isnan(x) else x}
                for s, x in zip(st.tolist(), v.tolist(), strict=True)
            ]
        conn.execute(points.insert(), batch)
    result.close()
    for level, size in OLD_LEVELS.items():
        op.execute(_reduce(level, size))
    op.execute("DROP VIEW point_windows")
    op.drop_table("point_tails")
    op.drop_table("point_chunks")
