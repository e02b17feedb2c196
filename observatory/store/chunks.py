"""The stored form of metric values: one row per series per window of `WINDOW` steps.

A row holds the window's steps and values packed and compressed, and the window's exact
summary (count, NaN count and first NaN step, minimum and maximum with their steps):

- values: float32 when every value of the window survives the round trip through float32
  exactly (what the trainer's probes compute: per-layer and per-head statistics), float64
  otherwise (a learning rate, a loss averaged in Python): nothing is rounded. NaN and +-inf
  are stored as themselves. The bytes are shuffled (all first bytes, then all second bytes...)
  so the slowly changing sign and exponent bytes sit together, then zstd-compressed.
- steps: NULL when the window holds every step from `first_step` to `last_step` (the usual
  case); otherwise the offsets from the window's first step as uint16, zstd-compressed.

A query whose buckets are whole windows reads the summary columns only; narrower buckets decode
the windows they touch (`decode`) and reduce them with numpy (`reduce_buckets`). Ties between
equal extremes go to the earliest step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

__all__ = [
    "ROW_COLUMNS",
    "SUMMARY_COLUMNS",
    "WINDOW",
    "Buckets",
    "decode",
    "encode",
    "reduce_points",
    "reduce_buckets",
]

WINDOW = 512  # steps per row: ~100 bytes of row overhead spread over up to 512 values
LEVEL = 3  # zstd's default: within 2% of level 19 on this data, ~80 ns per value

SUMMARY_COLUMNS = (
    "first_step",
    "last_step",
    "n",
    "n_nan",
    "nan_step",
    "min_value",
    "min_step",
    "max_value",
    "max_step",
)
ROW_COLUMNS = ("series_id", "win", *SUMMARY_COLUMNS, "steps", "vals")

_local = threading.local()  # zstd's (de)compressor objects are not thread-safe: one per thread


def _compress(data: bytes) -> bytes:
    c = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = zstandard.ZstdCompressor(level=LEVEL)
    return c.compress(data)


def _decompress(data: bytes) -> bytes:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d.decompress(data)


def _shuffle(a: np.ndarray) -> bytes:
    return a.view(np.uint8).reshape(-1, a.itemsize).T.tobytes()


def _unshuffle(raw: bytes, n: int) -> np.ndarray:
    size = len(raw) // n if n else 8
    dtype = np.float32 if size == 4 else np.float64
    planes = np.frombuffer(raw, np.uint8).reshape(size, n)
    return planes.T.copy().view(dtype).ravel().astype(np.float64)


def encode(series_id: int, steps: np.ndarray, values: np.ndarray) -> tuple[Any, ...]:
    """The row (in `ROW_COLUMNS` order) of one window: `steps` ascending, unique, all in one
    window; `values` float64 of the same length."""
    n = len(steps)
    first, last = int(steps[0]), int(steps[-1])
    win = first // WINDOW
    nan = np.isnan(values)
    n_nan = int(np.count_nonzero(nan))
    nan_step = int(steps[int(nan.argmax())]) if n_nan else None
    lo: tuple[Any, Any] = (None, None)
    hi: tuple[Any, Any] = (None, None)
    if n_nan < n:  # argmin/argmax give the first of ties; NaN would win them, so fill it
        real = np.where(nan, np.inf, values) if n_nan else values
        i = int(real.argmin())
        real = np.where(nan, -np.inf, values) if n_nan else values
        j = int(real.argmax())
        if n_nan and nan[i]:  # every real value is +inf
            i = int(np.flatnonzero(values == np.inf)[0])
        if n_nan and nan[j]:  # every real value is -inf
            j = int(np.flatnonzero(values == -np.inf)[0])
        lo, hi = (float(values[i]), int(steps[i])), (float(values[j]), int(steps[j]))
    narrow = values.astype(np.float32)
    same = narrow.astype(np.float64) == values
    if bool(same.all()) or bool((same | nan).all()):
        vals = _compress(_shuffle(narrow))
    else:
        vals = _compress(_shuffle(values))
    packed = None
    if last - first + 1 != n:
        packed = _compress((steps - win * WINDOW).astype("<u2").tobytes())
    return (series_id, win, first, last, n, n_nan, nan_step, *lo, *hi, packed, vals)


def decode(
    win: int, first: int, last: int, n: int, steps: bytes | None, vals: bytes
) -> tuple[np.ndarray, np.ndarray]:
    """Steps (int64) and values (float64) of one stored window."""
    if steps is None:
        st = np.arange(first, last + 1, dtype=np.int64)
    else:
        offsets = np.frombuffer(_decompress(steps), "<u2")
        st = offsets.astype(np.int64) + win * WINDOW
    return st, _unshuffle(_decompress(vals), n)


@dataclass
class Buckets:
    """Reduced buckets, one entry per (group, bucket), as parallel arrays.

    `min_value`/`max_value` are NaN (and their steps -1) when every value is NaN; `nan_step`
    is -1 when there is no NaN."""

    group: np.ndarray
    bucket: np.ndarray
    n: np.ndarray
    n_nan: np.ndarray
    nan_step: np.ndarray
    min_value: np.ndarray
    min_step: np.ndarray
    max_value: np.ndarray
    max_step: np.ndarray

    def cells(self, labels: list[Any]) -> dict[tuple[Any, int], list[Any]]:
        """{(label, bucket): [n, n_nan, nan_step, min, min_step, max, max_step]}, None for
        missing entries."""
        cols = zip(
            self.n.tolist(),
            self.n_nan.tolist(),
            _none_below_zero(self.nan_step),
            *_value_step(self.min_value, self.min_step),
            *_value_step(self.max_value, self.max_step),
            strict=True,
        )
        keys = zip(map(labels.__getitem__, self.group.tolist()), self.bucket.tolist(), strict=True)
        return dict(zip(keys, map(list, cols), strict=True))

    def subset(self, mask: np.ndarray) -> Buckets:
        return Buckets(*(getattr(self, f)[mask] for f in _FIELDS))

    def grids(self, rows: np.ndarray, n_rows: int) -> tuple[Any, ...]:
        """Bucket numbers and rows x buckets grids of n, n_nan, min, min step, max, max step
        (0 or None where a row has no value), `rows` giving each entry's row."""
        ks, col = np.unique(self.bucket, return_inverse=True)
        shape = (n_rows, len(ks))

        def fill(values: np.ndarray, empty: Any, missing: np.ndarray | None) -> list[list[Any]]:
            grid = np.full(shape, empty, object)
            cells = values.astype(object)
            if missing is not None:
                cells[missing] = None
            grid[rows, col] = cells
            return grid.tolist()

        no_min, no_max = np.isnan(self.min_value), np.isnan(self.max_value)
        return (
            ks.tolist(),
            fill(self.n, 0, None),
            fill(self.n_nan, 0, None),
            fill(self.min_value, None, no_min),
            fill(self.min_step, None, no_min),
            fill(self.max_value, None, no_max),
            fill(self.max_step, None, no_max),
        )


def reduce_buckets(parts: list[Buckets], width: int) -> Buckets:
    """Summaries (raw points are one-step summaries, `bucket` = their step) grouped by
    `(group, bucket // width)`: counts added, the smaller minimum and larger maximum kept
    (earliest step on ties), the first NaN step."""
    s = Buckets(*(np.concatenate([getattr(p, f) for p in parts]) for f in _FIELDS))
    if not len(s.n):
        return s
    key = s.group * (1 << 32) + s.bucket // width
    if len(key) > 1 and not bool(np.all(key[1:] >= key[:-1])):
        order = np.argsort(key, kind="stable")
        s, key = Buckets(*(getattr(s, f)[order] for f in _FIELDS)), key[order]
    edge = np.empty(len(key), bool)
    edge[0] = True
    np.not_equal(key[1:], key[:-1], out=edge[1:])
    starts = np.flatnonzero(edge)
    gid = np.cumsum(edge) - 1
    big = np.iinfo(np.int64).max
    nan_step = np.minimum.reduceat(np.where(s.nan_step < 0, big, s.nan_step), starts)
    mn, mn_s = _extreme(s.min_value, s.min_step, starts, gid, np.minimum, np.inf)
    mx, mx_s = _extreme(s.max_value, s.max_step, starts, gid, np.maximum, -np.inf)
    return Buckets(
        s.group[starts],
        key[starts] & ((1 << 32) - 1),
        np.add.reduceat(s.n, starts),
        np.add.reduceat(s.n_nan, starts),
        np.where(nan_step == big, -1, nan_step),
        mn,
        mn_s,
        mx,
        mx_s,
    )


def _extreme(
    v: np.ndarray, st: np.ndarray, starts: np.ndarray, gid: np.ndarray, op: Any, fill: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per group: the extreme of `v` (NaN entries mean "none") and the earliest step holding
    it; NaN and -1 for a group with none."""
    nan = np.isnan(v)
    best = op.reduceat(np.where(nan, fill, v), starts)
    none = np.add.reduceat(~nan, starts) == 0
    big = np.iinfo(np.int64).max
    steps = np.minimum.reduceat(np.where(v == best[gid], st, big), starts)
    return np.where(none, np.nan, best), np.where(none, -1, steps)


def reduce_points(groups: np.ndarray, steps: np.ndarray, values: np.ndarray, width: int) -> Buckets:
    """Raw points reduced into buckets of `width` steps per group (`bucket` is the bucket's
    first step, so `reduce_buckets` with the same width keeps them whole)."""
    key = groups * (1 << 32) + steps // width
    if len(key) > 1 and not bool(np.all(key[1:] >= key[:-1])):
        order = np.argsort(key, kind="stable")
        groups, steps, values, key = groups[order], steps[order], values[order], key[order]
    edge = np.empty(len(key), bool)
    edge[0] = True
    np.not_equal(key[1:], key[:-1], out=edge[1:])
    starts = np.flatnonzero(edge)
    gid = np.cumsum(edge) - 1
    nan = np.isnan(values)
    big = np.iinfo(np.int64).max
    nan_step = np.minimum.reduceat(np.where(nan, steps, big), starts)
    mn, mn_s = _extreme(values, steps, starts, gid, np.minimum, np.inf)
    mx, mx_s = _extreme(values, steps, starts, gid, np.maximum, -np.inf)
    return Buckets(
        groups[starts],
        (key[starts] & ((1 << 32) - 1)) * width,
        np.diff(np.append(starts, len(key))),
        np.add.reduceat(nan.astype(np.int64), starts),
        np.where(nan_step == big, -1, nan_step),
        mn,
        mn_s,
        mx,
        mx_s,
    )


_FIELDS = tuple(Buckets.__dataclass_fields__)


def _none_below_zero(a: np.ndarray) -> list[int | None]:
    return [None if x < 0 else x for x in a.tolist()]


def _value_step(v: np.ndarray, s: np.ndarray) -> tuple[list[float | None], list[int | None]]:
    vals, steps = v.tolist(), s.tolist()
    for i in np.flatnonzero(np.isnan(v)).tolist():
        vals[i] = None
        steps[i] = None
    return vals, steps
