"""Min/max reduction in SQL: the queries' buckets from stored blocks and raw points.

It reduces rows of one shape, "summary rows":
`(series_id, pos, n, n_nan, nan_step, min_value, min_step, max_value, max_step)`, where a raw
point is the summary of one step (`pos = step`, `n = 1`) and a stored block is the summary of
its steps (observatory/rollup.py builds those at write time). Grouping summary rows by
`pos / width` and reducing them gives summaries again, so blocks and the ragged raw edges of a
range reduce together into buckets.

The extreme's step must come from the row that holds the extreme. PostgreSQL does it in one pass
with `min(ARRAY[value, step])` (arrays compare element-wise: ties go to the earliest step).
SQLite has no arrays but documents that a bare column next to a single `min()`/`max()` comes
from the row holding it, so it takes one pass for the minimum and one for the maximum (on ties
SQLite picks one of the tied steps).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BLOCK_AS_SUMMARY", "POINT_AS_SUMMARY", "reduce_rows", "reduce_sql"]

# a raw point written as a one-step summary row (columns in SUMMARY order)
POINT_AS_SUMMARY = (
    "series_id, step AS pos, 1 AS n, CASE WHEN value IS NULL THEN 1 ELSE 0 END AS n_nan, "
    "CASE WHEN value IS NULL THEN step END AS nan_step, value AS min_value, step AS min_step, "
    "value AS max_value, step AS max_step"
)
BLOCK_AS_SUMMARY = (
    "series_id, block * {size} AS pos, n, n_nan, nan_step, min_value, min_step, max_value, max_step"
)


def reduce_sql(dialect: str, source: str, group: str) -> str:
    """SQL that reduces the summary rows of `source` grouped by `(series_id, <group>)`.

    `source` is a subquery (no parentheses) yielding summary columns; `group` an expression over
    them (e.g. `pos / 8`). Result columns: `series_id, g, n, n_nan, nan_step, min_value,
    min_step, max_value, max_step`.
    """
    if dialect == "postgresql":
        return _reduce_pg(source, group)
    if dialect == "sqlite":
        return _reduce_sqlite(source, group)
    raise ValueError(f"unsupported SQL dialect {dialect!r}")


def _reduce_pg(source: str, group: str) -> str:
    return f"""
SELECT series_id, g, n, n_nan, nan_step,
       mn[1] AS min_value, CAST(mn[2] AS INTEGER) AS min_step,
       mx[1] AS max_value, CAST(-mx[2] AS INTEGER) AS max_step
FROM (
  SELECT series_id, {group} AS g, SUM(n) AS n, SUM(n_nan) AS n_nan, MIN(nan_step) AS nan_step,
         MIN(ARRAY[min_value, min_step::float8]) FILTER (WHERE min_value IS NOT NULL) AS mn,
         MAX(ARRAY[max_value, -max_step::float8]) FILTER (WHERE max_value IS NOT NULL) AS mx
  FROM ({source}) AS src
  GROUP BY series_id, g
) AS r"""


def _reduce_sqlite(source: str, group: str) -> str:
    """One statement (used where a single SQL text is needed; `reduce_rows` is faster)."""
    a, b, c = _sqlite_passes(source, group)
    return f"""
SELECT a.series_id, a.g, a.n, a.n_nan, c.nan_step,
       a.min_value, CASE WHEN a.min_value IS NULL THEN NULL ELSE a.min_step END AS min_step,
       b.max_value, CASE WHEN b.max_value IS NULL THEN NULL ELSE b.max_step END AS max_step
FROM ({a}) AS a
JOIN ({b}) AS b ON b.series_id = a.series_id AND b.g = a.g
LEFT JOIN ({c}) AS c ON c.series_id = a.series_id AND c.g = a.g"""


def _sqlite_passes(source: str, group: str) -> tuple[str, str, str]:
    """min + its step (and the counts), max + its step, first NaN step."""
    return (
        f"SELECT series_id, {group} AS g, SUM(n) AS n, SUM(n_nan) AS n_nan, "
        f"MIN(min_value) AS min_value, min_step FROM ({source}) GROUP BY series_id, g",
        f"SELECT series_id, {group} AS g, MAX(max_value) AS max_value, max_step "
        f"FROM ({source}) GROUP BY series_id, g",
        f"SELECT series_id, {group} AS g, MIN(nan_step) AS nan_step "
        f"FROM ({source}) WHERE nan_step IS NOT NULL GROUP BY series_id, g",
    )


def reduce_rows(
    cursor: Any, dialect: str, source: str, group: str, *, with_min: bool = True
) -> list[tuple[Any, ...]]:
    """Run the reduction on a DB-API cursor; rows as `reduce_sql` describes them.

    On SQLite the passes run as separate statements joined here by key (cheaper than SQLite's
    join of three grouped subqueries), and the NaN pass only when some group has a NaN.
    `with_min=False` (a heatmap of maxima) skips the minimum pass: min_value and min_step come
    back None, everything else as usual.
    """
    if dialect != "sqlite":
        cursor.execute(reduce_sql(dialect, source, group))
        rows = list(cursor.fetchall())
        return rows if with_min else [(*r[:5], None, None, *r[7:]) for r in rows]
    pass_min, pass_max, pass_nan = _sqlite_passes(source, group)
    if not with_min:
        return _max_only(cursor, source, group, pass_nan)
    cursor.execute(pass_max)
    maxima = {(sid, g): (mx, ms) for sid, g, mx, ms in cursor.fetchall()}
    cursor.execute(pass_min)
    mins = cursor.fetchall()
    nan_steps: dict[tuple[int, int], int] = {}
    if any(row[3] for row in mins):
        cursor.execute(pass_nan)
        nan_steps = {(sid, g): step for sid, g, step in cursor.fetchall()}
    out = []
    for sid, g, n, n_nan, mn, mn_s in mins:
        mx, mx_s = maxima[sid, g]
        out.append(
            (
                sid,
                g,
                n,
                n_nan,
                nan_steps.get((sid, g)),
                mn,
                None if mn is None else mn_s,
                mx,
                None if mx is None else mx_s,
            )
        )
    return out


def _max_only(cursor: Any, source: str, group: str, pass_nan: str) -> list[tuple[Any, ...]]:
    cursor.execute(
        f"SELECT series_id, {group} AS g, SUM(n) AS n, SUM(n_nan) AS n_nan, "
        f"MAX(max_value) AS max_value, max_step FROM ({source}) GROUP BY series_id, g"
    )
    rows = cursor.fetchall()
    nan_steps: dict[tuple[int, int], int] = {}
    if any(row[3] for row in rows):
        cursor.execute(pass_nan)
        nan_steps = {(sid, g): step for sid, g, step in cursor.fetchall()}
    return [
        (sid, g, n, n_nan, nan_steps.get((sid, g)), None, None, mx, None if mx is None else ms)
        for sid, g, n, n_nan, mx, ms in rows
    ]
