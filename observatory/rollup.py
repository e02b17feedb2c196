"""Block deltas for a batch of new points, computed with numpy before they reach the database.

The writer knows the batch's new points; reducing them here (two stable sorts per level) costs a
fraction of the same GROUP BY in SQLite, and the result is merged into `point_blocks` by an
upsert that adds counts and keeps the smaller minimum / larger maximum (observatory/ingest.py).
Ties go to the earliest step, as in PostgreSQL's query-side reduction (observatory/m4.py).

A `Summary` is the column form of the summary rows of observatory/m4.py: NaN for "no min/max"
(every value NaN) and -1 for "no step".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from observatory.models import BLOCK_LEVELS

__all__ = ["Summary", "levels"]


@dataclass
class Summary:
    sid: np.ndarray  # int64 series ids, sorted with pos
    pos: np.ndarray  # int64 step (points) or block number
    n: np.ndarray
    n_nan: np.ndarray
    nan_step: np.ndarray  # -1: none
    min_value: np.ndarray  # float64, NaN: none
    min_step: np.ndarray
    max_value: np.ndarray
    max_step: np.ndarray

    @classmethod
    def of_points(cls, sid: np.ndarray, step: np.ndarray, value: np.ndarray) -> Summary:
        """Points sorted by (sid, step) as one-step summaries."""
        nan = np.isnan(value)
        return cls(
            sid,
            step,
            np.ones(len(sid), np.int64),
            nan.astype(np.int64),
            np.where(nan, step, -1),
            value,
            step,
            value,
            step,
        )

    def reduce(self, factor: int) -> Summary:
        """Group rows by (sid, pos // factor) and reduce; rows must be sorted by (sid, pos)."""
        g = self.pos // factor
        edge = np.empty(len(g), bool)
        edge[0] = True
        np.not_equal(self.sid[1:], self.sid[:-1], out=edge[1:])
        edge[1:] |= g[1:] != g[:-1]
        starts = np.flatnonzero(edge)
        gid = np.cumsum(edge) - 1
        nan_step = np.where(self.nan_step < 0, np.iinfo(np.int64).max, self.nan_step)
        nan_step = np.minimum.reduceat(nan_step, starts)
        imin = np.lexsort((self.min_step, self.min_value, gid))[starts]  # NaN sorts last
        imax = np.lexsort((self.max_step, -self.max_value, gid))[starts]
        return Summary(
            self.sid[starts],
            g[starts],
            np.add.reduceat(self.n, starts),
            np.add.reduceat(self.n_nan, starts),
            np.where(nan_step == np.iinfo(np.int64).max, -1, nan_step),
            self.min_value[imin],
            self.min_step[imin],
            self.max_value[imax],
            self.max_step[imax],
        )

    def rows(self, level: int) -> list[tuple[object, ...]]:
        """DB rows `(series_id, level, block, n, n_nan, nan_step, min_value, min_step,
        max_value, max_step)` with None for missing values."""
        cols = [
            self.sid.tolist(),
            [level] * len(self.sid),
            self.pos.tolist(),
            self.n.tolist(),
            self.n_nan.tolist(),
            _none_below_zero(self.nan_step),
            *_value_step(self.min_value, self.min_step),
            *_value_step(self.max_value, self.max_step),
        ]
        return list(zip(*cols, strict=True))


def _none_below_zero(a: np.ndarray) -> list[int | None]:
    return [None if x < 0 else x for x in a.tolist()]


def _value_step(v: np.ndarray, s: np.ndarray) -> tuple[list[float | None], list[int | None]]:
    vals = v.tolist()
    steps = s.tolist()
    nan = np.isnan(v)
    if nan.any():
        for i in np.flatnonzero(nan).tolist():
            vals[i] = None
            steps[i] = None
    return vals, steps


def levels(points: Summary) -> Iterator[tuple[int, Summary]]:
    """(level, block deltas) for every rollup level, each reduced from the one below."""
    cur, prev = points, 1
    for level, size in BLOCK_LEVELS.items():
        cur = cur.reduce(size // prev)
        prev = size
        yield level, cur
