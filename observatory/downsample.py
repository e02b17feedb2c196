"""The downsampling core of observatory/store.py: branch lineage, bucket grid, SQL source.

A query is a list of segments `(group label, series id, first step, last step)`. The grid picks
a bucket width that is a whole multiple of the largest rollup block not wider than the asked
width, so every bucket is a union of whole blocks; `_source` reads whole blocks from
`point_blocks` and raw points only for the ragged edges of each segment, and observatory/m4.py
reduces them to buckets in SQL. A bucket that straddles a fork gets one row per segment; they
are merged here (the only reduction done in Python: a handful of rows per bucket).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from observatory.m4 import BLOCK_AS_SUMMARY, POINT_AS_SUMMARY, reduce_rows
from observatory.models import BLOCK_LEVELS, Branch

__all__ = ["END", "MAX_BUCKETS", "Segment", "Tree", "branch_tree", "downsample", "grid", "lineage"]

MAX_BUCKETS = 100_000
END = 2**31 - 1
# (group label, series id, first step, last step); a label is any hashable (a branch, a layer,
# a (run, layer) pair when many runs are read at once)
Segment = tuple[Any, int, int, int]
Tree = dict[int, tuple[int | None, int | None]]  # branch -> (parent, fork step)


def branch_tree(session: Session, run_pk: int) -> dict[int, tuple[int | None, int | None]]:
    q = select(Branch.number, Branch.parent, Branch.fork_step).where(Branch.run_id == run_pk)
    return {n: (p, f) for n, p, f in session.execute(q)}


def lineage(
    tree: dict[int, tuple[int | None, int | None]], branch: int
) -> list[tuple[int, int, int]]:
    """[(branch, first step, last step)] from the oldest ancestor to `branch`."""
    parts: list[tuple[int, int, int]] = []
    upper, cur, seen = END, branch, set()
    while cur is not None and cur not in seen:
        seen.add(cur)
        parent, fork = tree.get(cur, (None, None))
        lower = fork + 1 if parent is not None and fork is not None else 0
        if lower <= upper:
            parts.append((cur, lower, upper))
        if parent is None or fork is None:
            break
        upper, cur = min(upper, fork), parent
    return parts[::-1]


def downsample(
    session: Session,
    segs: list[Segment],
    buckets: int,
    start: int | None,
    end: int | None,
    *,
    with_min: bool = True,
) -> tuple[int, dict[tuple[Any, int], Any], list[Segment]]:
    """Bucket width, {(group, bucket index): [n, n_nan, nan_step, min, min_step, max,
    max_step]} and the segments as read (clipped to [start, end] and to the stored steps)."""
    if not 1 <= buckets <= MAX_BUCKETS:
        raise ValueError(f"buckets must be in [1, {MAX_BUCKETS}], got {buckets}")
    segs = _clip(session, segs, start, end)
    if not segs:
        return 1, {}, []
    lo, hi = min(s[2] for s in segs), max(s[3] for s in segs)
    width, level, size = grid(lo, hi, buckets)
    dialect = session.get_bind().dialect.name
    cursor = session.connection().connection.cursor()  # raw rows: no per-row ORM work
    try:
        rows = reduce_rows(
            cursor, dialect, _source(segs, level, size), f"pos / {width}", with_min=with_min
        )
    finally:
        cursor.close()
    group_of = {sid: g for g, sid, _, _ in segs}
    cells: dict[tuple[Any, int], Any] = {}
    if len(set(group_of.values())) == len(group_of):  # one series per group: nothing to merge
        for r in rows:
            cells[group_of[r[0]], r[1]] = r[2:]
    else:
        for r in rows:
            merge_cells(cells, (group_of[r[0]], r[1]), list(r[2:]))
    return width, cells, segs


def _clip(
    session: Session, segs: list[Segment], start: int | None, end: int | None
) -> list[Segment]:
    """Intersect each segment with [start, end] and with the steps its series actually holds."""
    if not segs:
        return []
    ids = ", ".join(str(int(s[1])) for s in segs)
    q = text(
        "SELECT s.id, (SELECT MIN(step) FROM points WHERE series_id = s.id), "
        f"(SELECT MAX(step) FROM points WHERE series_id = s.id) FROM series s WHERE s.id IN ({ids})"
    )
    extent = {sid: (a, b) for sid, a, b in session.execute(q)}
    out = []
    for g, sid, lo, hi in segs:
        a, b = extent.get(sid, (None, None))
        if a is None:
            continue
        lo, hi = (
            max(lo, a, start if start is not None else 0),
            min(hi, b, end if end is not None else END),
        )
        if lo <= hi:
            out.append((g, sid, lo, hi))
    return out


def grid(lo: int, hi: int, buckets: int) -> tuple[int, int, int]:
    """Bucket width (a multiple of the chosen block size), block level and block size."""
    want = -(-(hi - lo + 1) // buckets)
    level, size = 0, 1
    for lvl, sz in BLOCK_LEVELS.items():
        if sz <= want:
            level, size = lvl, sz
    width = -(-want // size) * size
    while hi // width - lo // width + 1 > buckets:
        width += size
    return width, level, size


def _source(segs: list[Segment], level: int, size: int) -> str:
    """UNION ALL of whole blocks inside each segment and raw points at the ragged edges.

    Segments with the same block range share one `series_id IN (...)` term (a heatmap's rows
    usually all do), which SQLite and PostgreSQL answer with one index range per series.
    """
    by_range: dict[tuple[int, int], list[int]] = {}
    raw = []
    for _, sid, lo, hi in segs:
        first, last = (-(-lo // size), (hi + 1) // size - 1) if level else (1, 0)
        if first <= last:
            by_range.setdefault((first, last), []).append(sid)
            edges = [(lo, first * size - 1), ((last + 1) * size, hi)]
        else:
            edges = [(lo, hi)]
        raw += [f"(series_id = {sid} AND step BETWEEN {a} AND {b})" for a, b in edges if a <= b]
    blocks = [
        f"(series_id IN ({', '.join(map(str, sids))}) AND block BETWEEN {first} AND {last})"
        for (first, last), sids in by_range.items()
    ]
    parts = []
    if blocks:
        where = " OR ".join(blocks)
        cols = BLOCK_AS_SUMMARY.format(size=size)
        parts.append(f"SELECT {cols} FROM point_blocks WHERE level = {level} AND ({where})")
    if raw:
        parts.append(f"SELECT {POINT_AS_SUMMARY} FROM points WHERE {' OR '.join(raw)}")
    return " UNION ALL ".join(parts)


def merge_cells(cells: dict[tuple[Any, int], Any], key: tuple[Any, int], c: list[Any]) -> None:
    """Combine two partial buckets (a bucket can straddle a fork): smaller min, larger max."""
    old = cells.get(key)
    if old is None:
        cells[key] = c
        return
    old[0] += c[0]
    old[1] += c[1]
    if c[2] is not None and (old[2] is None or c[2] < old[2]):
        old[2] = c[2]
    if c[3] is not None and (old[3] is None or (c[3], c[4]) < (old[3], old[4])):
        old[3], old[4] = c[3], c[4]
    if c[5] is not None and (old[5] is None or (c[5], -c[6]) > (old[5], -old[6])):
        old[5], old[6] = c[5], c[6]
