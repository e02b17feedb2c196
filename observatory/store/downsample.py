"""The downsampling core of observatory/store/queries.py: branch lineage, bucket grid, window reads.

A query is a list of segments `(group label, series id, first step, last step)`. A bucket at
least a window wide is a whole number of windows (observatory/store/chunks.py), so the windows
inside a segment are read as their stored summaries (no values decoded) and only the windows at the
ragged edges of a segment are decoded; narrower buckets decode every window they touch. numpy
then reduces summaries and points together into buckets per group (a group's segments, one per
branch of a lineage, never share a step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from spikewatch.observatory.store.chunks import (
    WINDOW,
    Buckets,
    decode,
    reduce_buckets,
    reduce_points,
)
from spikewatch.observatory.store.models import Branch

__all__ = [
    "END",
    "MAX_BUCKETS",
    "Segment",
    "Tree",
    "branch_tree",
    "downsample",
    "downsample_buckets",
    "grid",
    "lineage",
]

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
    max_step]} and the segments as read (clipped to [start, end] and to the stored steps).
    `with_min=False` (a heatmap of maxima) returns None for the minimum and its step."""
    width, found, labels, segs = downsample_buckets(session, segs, buckets, start, end)
    cells = found.cells(labels)
    if not with_min:
        for c in cells.values():
            c[3] = c[4] = None
    return width, cells, segs


def downsample_buckets(
    session: Session, segs: list[Segment], buckets: int, start: int | None, end: int | None
) -> tuple[int, Buckets, list[Any], list[Segment]]:
    """`downsample` as arrays: bucket width, the buckets (`group` indexes the labels), the
    group labels and the segments as read."""
    if not 1 <= buckets <= MAX_BUCKETS:
        raise ValueError(f"buckets must be in [1, {MAX_BUCKETS}], got {buckets}")
    segs = _clip(session, segs, start, end)
    labels = list(dict.fromkeys(g for g, _, _, _ in segs))
    if not segs:
        return 1, reduce_buckets([_EMPTY], 1), labels, []
    lo, hi = min(s[2] for s in segs), max(s[3] for s in segs)
    width = grid(lo, hi, buckets)
    return width, reduce_buckets(_read(session, segs, labels, width), width), labels, segs


def _clip(
    session: Session, segs: list[Segment], start: int | None, end: int | None
) -> list[Segment]:
    """Intersect each segment with [start, end] and with the steps its series actually holds."""
    if not segs:
        return []
    ids = ", ".join(str(int(s[1])) for s in segs)
    q = " UNION ALL ".join(
        f"SELECT s.id, (SELECT first_step FROM {t} WHERE series_id = s.id ORDER BY win LIMIT 1), "
        f"(SELECT last_step FROM {t} WHERE series_id = s.id ORDER BY win DESC LIMIT 1) "
        f"FROM series s WHERE s.id IN ({ids})"
        for t in ("point_chunks", "point_tails")  # each by its primary key (not the view's union)
    )
    extent: dict[int, tuple[int, int]] = {}
    for sid, a, b in session.execute(text(q)):
        if a is not None:
            old = extent.get(sid, (a, b))
            extent[sid] = (min(a, old[0]), max(b, old[1]))
    out = []
    for g, sid, lo, hi in segs:
        if sid not in extent:
            continue
        a, b = extent[sid]
        lo, hi = (
            max(lo, a, start if start is not None else 0),
            min(hi, b, end if end is not None else END),
        )
        if lo <= hi:
            out.append((g, sid, lo, hi))
    return out


def grid(lo: int, hi: int, buckets: int) -> int:
    """Bucket width. A whole number of windows when that costs at most a tenth of the buckets
    asked for (then whole windows are read as their stored summaries, nothing decoded)."""
    want = -(-(hi - lo + 1) // buckets)
    aligned = -(-want // WINDOW) * WINDOW
    step = WINDOW if aligned * 10 <= want * 11 else 1
    width = -(-want // step) * step
    while hi // width - lo // width + 1 > buckets:
        width += step
    return width


_EMPTY = Buckets(*(np.empty(0, np.float64 if i in (5, 7) else np.int64) for i in range(9)))
_SUMMARY = "series_id, first_step, n, n_nan, nan_step, min_value, min_step, max_value, max_step"
_PACKED = "series_id, win, first_step, last_step, n, steps, vals"


def _read(session: Session, segs: list[Segment], labels: list[Any], width: int) -> list[Buckets]:
    """Summaries of the whole windows inside each segment (when buckets are whole windows) and
    the decoded points of every other window, as Buckets of group indices."""
    index = {lab: i for i, lab in enumerate(labels)}
    seg_of = {sid: (index[g], lo, hi) for g, sid, lo, hi in segs}
    whole: dict[tuple[int, int], list[int]] = {}  # (first, last window) -> series
    packed: dict[tuple[int, int], list[int]] = {}
    for _, sid, lo, hi in segs:
        first, last = lo // WINDOW, hi // WINDOW
        if width % WINDOW == 0:
            inner = (-(-lo // WINDOW), (hi + 1) // WINDOW - 1)
            if inner[0] <= inner[1]:
                whole.setdefault(inner, []).append(sid)
                edges = [(first, inner[0] - 1), (inner[1] + 1, last)]
            else:
                edges = [(first, last)]
        else:
            edges = [(first, last)]
        for a, b in edges:
            if a <= b:
                packed.setdefault((a, b), []).append(sid)
    conn = session.connection()
    parts = []
    if whole:
        summaries = list(
            conn.exec_driver_sql(f"SELECT {_SUMMARY} FROM point_windows WHERE {_where(whole)}")
        )
        if summaries:
            parts.append(_summaries(summaries, seg_of))
    if packed:
        rows = conn.exec_driver_sql(f"SELECT {_PACKED} FROM point_windows WHERE {_where(packed)}")
        parts.append(_points(rows, seg_of, width))
    return parts


def _where(ranges: dict[tuple[int, int], list[int]]) -> str:
    return " OR ".join(
        f"(series_id IN ({', '.join(map(str, sids))}) AND win BETWEEN {a} AND {b})"
        for (a, b), sids in ranges.items()
    )


def _summaries(rows: list[Any], seg_of: dict[int, tuple[int, int, int]]) -> Buckets:
    sid, first, n, n_nan, nan_step, mn, mn_s, mx, mx_s = zip(*rows, strict=True)

    def ints(xs: tuple[Any, ...]) -> np.ndarray:
        return np.array([-1 if x is None else x for x in xs], np.int64)

    def floats(xs: tuple[Any, ...]) -> np.ndarray:
        return np.array([np.nan if x is None else x for x in xs], np.float64)

    return Buckets(
        np.array([seg_of[s][0] for s in sid], np.int64),
        np.array(first, np.int64),
        np.array(n, np.int64),
        np.array(n_nan, np.int64),
        ints(nan_step),
        floats(mn),
        ints(mn_s),
        floats(mx),
        ints(mx_s),
    )


def _points(rows: Any, seg_of: dict[int, tuple[int, int, int]], width: int) -> Buckets:
    """The decoded values of `rows`, clipped to their segments, reduced into buckets."""
    pieces = []
    for sid, win, first, last, n, packed, vals in rows:
        g, lo, hi = seg_of[sid]
        st, v = decode(win, first, last, n, packed, vals)
        if st[0] < lo or st[-1] > hi:
            keep = (st >= lo) & (st <= hi)
            st, v = st[keep], v[keep]
        if len(st):
            pieces.append((g, int(st[0]), st, v))
    if not pieces:
        return _EMPTY
    pieces.sort(key=lambda p: p[:2])  # by group, then step: buckets come out contiguous
    groups = np.repeat([p[0] for p in pieces], [len(p[2]) for p in pieces])
    steps = np.concatenate([p[2] for p in pieces])
    return reduce_points(groups, steps, np.concatenate([p[3] for p in pieces]), width)
