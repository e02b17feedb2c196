"""TensorBoard event files without TensorFlow: TFRecord framing, checksums, scalar events.

A TFRecord is `uint64 length, uint32 masked CRC-32C of the length, data, uint32 masked CRC-32C
of the data`; the data is an `Event` protobuf. `scan` reads whole files and `watch` reads
each file from where it stopped (`Records`); both decode scalars here, as `simple_value` or as a
one-element tensor.

`Records.read_scalars` turns the new bytes of a file into one column per tag in bulk, because a
SummaryWriter writes one record per scalar and a large run's log holds 100M of them:

- framing: every event a SummaryWriter writes starts with its wall time (field 1, byte 0x09).
  The positions with that byte where a record's data would start are candidates; a candidate is
  kept where another candidate's length lands on it, and linked to the next kept one where its
  own length lands exactly there. A run of links from a known record boundary is *proved*: it is
  the framing a record-by-record walk would find, and it is taken whole. Where a run breaks (a
  record that does not start that way, a look-alike inside data), one record is framed by itself
  and the next run starts. Length checksums are checked per distinct length.
- checksums: CRC-32C is affine in its input, so for records of one length it is a XOR of table
  lookups, one per byte pair, over the whole group at once (small groups: one C call a record).
- decoding: records of one length and one step-varint width share one layout, so the usual
  event (wall time, step, one `simple_value` with a short tag) is checked and decoded for a
  whole group at once in numpy; any other event takes the protobuf walk.
"""

from __future__ import annotations

import functools
import logging
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["EventError", "Records", "masked_crc", "scalars"]

log = logging.getLogger(__name__)

CHUNK = 4 << 20  # bytes read at once (small enough to stay in cache, large for numpy)
Columns = dict[str, tuple[np.ndarray, np.ndarray]]  # tag -> (steps int64, values float64)
_HEAD = struct.Struct("<QI")


class EventError(ValueError):
    """An event whose protobuf cannot be decoded."""


def masked_crc(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC-32C."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _mask(crc: np.ndarray) -> np.ndarray:
    crc = crc.astype(np.uint64)
    return ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF).astype(np.uint32)


# -- the protobuf walk ----------------------------------------------------------------------


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise EventError("truncated protobuf varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message, without a schema."""
    i = 0
    value: int | bytes
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:
            raise EventError(f"unsupported protobuf wire type {wire}")
        if i > len(buf):
            raise EventError("truncated protobuf field")
        yield field, wire, value


def _tensor_scalar(buf: bytes) -> float | None:
    dtype = None
    for field, wire, value in _fields(buf):
        if field == 1:
            dtype = value
        elif field == 5:  # float_val, packed or not
            return struct.unpack("<f", value[:4])[0]
        elif field == 6:
            return struct.unpack("<d", value[:8])[0]
        elif field == 4 and wire == 2 and value:  # tensor_content
            return struct.unpack("<d" if dtype == 2 else "<f", value[: 8 if dtype == 2 else 4])[0]
    return None


# One scalar per event, as SummaryWriters write them: Event{wall_time, step, summary{value{tag,
# simple_value}}}, every length one byte. Matched whole in C; anything else takes the walk.
_ONE_SCALAR = re.compile(rb"\x09.{8}\x10([\x80-\xff]{0,9}[\x00-\x7f])\x2a(.)\x0a(.)\x0a(.)", re.S)


def scalars(event: bytes) -> Iterator[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in one event."""
    m = _ONE_SCALAR.match(event)
    if m is not None:
        slen, vlen, tlen = m[2][0], m[3][0], m[4][0]
        p = m.end()
        if (
            slen == vlen + 2
            and vlen == tlen + 7
            and len(event) == p + tlen + 5
            and event[p + tlen] == 0x15
        ):
            raw, step = m[1], 0
            for k, b in enumerate(raw):
                step |= (b & 0x7F) << (7 * k)
            tag = event[p : p + tlen].decode("utf-8", "replace")
            yield step, tag, struct.unpack_from("<f", event, p + tlen + 1)[0]
            return
    yield from walk_scalars(event)


def walk_scalars(event: bytes) -> Iterator[tuple[int, str, float]]:
    """`scalars` by the general protobuf walk (any field order, tensors, many values)."""
    step, summary = 0, None
    for field, _, value in _fields(event):
        if field == 2:
            step = value
        elif field == 5:
            summary = value
    if summary is None:
        return
    for field, _, value in _fields(summary):
        if field != 1:
            continue
        tag, number = None, None
        for f, _, v in _fields(value):
            if f == 1:
                tag = v.decode("utf-8", "replace")
            elif f == 2:
                number = struct.unpack("<f", v)[0]
            elif f == 8:
                number = _tensor_scalar(v)
        if tag is not None and number is not None:
            yield step, tag, number


# -- framing --------------------------------------------------------------------------------


class _Chains:
    """The record starts that byte 0x09 and the lengths vouch for (see the module docstring):
    candidates some other candidate's length lands on, each linked to the next where its own
    length lands exactly there, with their length checksums checked."""

    def __init__(self, arr: np.ndarray) -> None:
        cand = np.flatnonzero(arr[12:] == 0x09) if len(arr) >= 16 else np.zeros(0, np.int64)
        size = np.minimum(_at(arr, cand, "<u8"), len(arr)).astype(np.int64)
        nxt = cand + 16 + size
        hit = np.searchsorted(cand, nxt)
        inside = np.flatnonzero(hit < len(cand))
        landed = hit[inside][cand[hit[inside]] == nxt[inside]]
        keep = np.zeros(len(cand), bool)
        keep[landed] = True  # some candidate's length lands here
        self.starts, self.size, self.nxt = cand[keep], size[keep], nxt[keep]
        self.breaks = np.flatnonzero(self.nxt[:-1] != self.starts[1:])  # link k -> k + 1 fails
        crc = _at(arr, self.starts + 8, "<u4")
        lengths, _, inverse = _distinct(self.size)
        want = np.array([masked_crc(struct.pack("<Q", int(n))) for n in lengths], np.uint32)
        self.bad = np.flatnonzero(want[inverse.ravel()] != crc)  # length checksum fails
        self.end = len(arr)

    def run(self, pos: int) -> tuple[int, int, bool]:
        """Chain indices [k, j) of the complete records from `pos` on, when `pos` starts one
        (else k == j), and whether record j's length fails its checksum."""
        k = int(np.searchsorted(self.starts, pos))
        if k == len(self.starts) or self.starts[k] != pos:
            return k, k, False
        b = int(np.searchsorted(self.breaks, k))
        j = int(self.breaks[b]) + 1 if b < len(self.breaks) else len(self.starts)
        j = k + int(np.searchsorted(self.nxt[k:j], self.end, side="right"))  # complete ones
        f = int(np.searchsorted(self.bad, k))
        if f < len(self.bad) and self.bad[f] < j:
            return k, int(self.bad[f]), True
        return k, j, False


def _at(arr: np.ndarray, pos: np.ndarray, dtype: str) -> np.ndarray:
    """The little-endian numbers at byte positions `pos` (each inside `arr`)."""
    width = np.dtype(dtype).itemsize
    if not len(pos):
        return np.zeros(0, dtype)
    return sliding_window_view(arr, width)[pos].view(dtype).ravel()


def _frame(buf: bytes) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """(starts, data lengths) of the complete records in `buf` whose lengths pass their
    checksum, the bytes they span, and whether a length failed (nothing after it is framed).
    Proved chains in bulk; a record outside them (and the first one) by itself."""
    chains = _Chains(np.frombuffer(buf, np.uint8))
    starts: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    pos = 0
    while pos + 12 <= len(buf):
        k, j, dead = chains.run(pos)
        if j > k:
            starts.append(chains.starts[k:j])
            sizes.append(chains.size[k:j])
            pos = int(chains.nxt[j - 1])
        if dead:
            return _cat(starts), _cat(sizes), int(chains.starts[j]), True
        if j > k:
            continue
        n, crc_len = _HEAD.unpack_from(buf, pos)  # one record by itself
        if masked_crc(buf[pos : pos + 8]) != crc_len:
            return _cat(starts), _cat(sizes), pos, True
        if pos + 16 + n > len(buf):
            break
        starts.append(np.array([pos], np.int64))
        sizes.append(np.array([n], np.int64))
        pos += 16 + n
    return _cat(starts), _cat(sizes), pos, False


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


# -- bulk checksums and decoding -------------------------------------------------------------


def _crc_table() -> np.ndarray:
    """CRC-32C (Castagnoli, reflected) of each single byte, from zero: the byte table."""
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, (c >> 1) ^ np.uint32(0x82F63B78), c >> 1).astype(np.uint32)
    return c


_BYTE_TABLE = _crc_table()


@functools.lru_cache(maxsize=16)
def _pair_tables(n: int) -> tuple[np.ndarray, int]:
    """CRC-32C is affine in its input: crc(x) = crc(0^n) ^ XOR_i T_i[x_i] for messages of n
    bytes, T_i[b] being byte b followed by n-1-i zero bytes. Tables of byte pairs (n/2 x 65536,
    a padding byte past the end counting zero), so a checksum is n/2 lookups; with the
    constant crc(0^n)."""
    m = n + n % 2
    t = np.zeros((m, 256), np.uint32)
    c = _BYTE_TABLE.copy()
    for i in range(n - 1, -1, -1):
        t[i] = c
        c = _BYTE_TABLE[c & 0xFF] ^ (c >> 8)  # one more zero byte after it
    pairs = (t[0::2][:, None, :] ^ t[1::2][:, :, None]).reshape(m // 2, 65536)
    return pairs, crc32c.crc32c(bytes(n))


def _checksums(arr: np.ndarray, data: np.ndarray, n: int, rows: np.ndarray | None) -> np.ndarray:
    """Masked CRC-32C of the n bytes at each of `data`; `rows`, when given, holds those bytes
    (and one more when n is odd), one record a row."""
    if rows is None:
        view = memoryview(arr.data)
        ends = (data + n).tolist()
        got = map(crc32c.crc32c, map(view.__getitem__, map(slice, data.tolist(), ends)))
        return _mask(np.fromiter(got, np.uint32, len(data)))
    pairs, zero = _pair_tables(n)
    words = rows.view("<u2")  # little-endian byte pairs
    crc = np.full(len(data), zero, np.uint32)
    for j in range(pairs.shape[0]):
        crc ^= pairs[j].take(words[:, j])
    return _mask(crc)


def _distinct(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`np.unique(x, return_index=True, return_inverse=True)` for integers with few distinct
    values (record lengths, tags), without sorting all of `x`."""
    values = np.unique(x)  # hashed, not sorted in full
    if len(values) > 64:
        return np.unique(x, return_index=True, return_inverse=True)
    inverse = np.searchsorted(values, x)
    first = np.array([np.argmax(inverse == j) for j in range(len(values))], np.int64)
    return values, first, inverse


def _tag_ids(tags: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """The distinct rows of a (records, length) byte matrix and each row's index among them:
    by a 64-bit fingerprint, checked against the rows (a collision falls back to sorting the
    rows themselves)."""
    width = -(-tags.shape[1] // 8) * 8
    padded = np.zeros((len(tags), width), np.uint8)
    padded[:, : tags.shape[1]] = tags
    words = padded.view("<u8")
    fp = np.zeros(len(tags), np.uint64)
    for j in range(words.shape[1]):
        fp = (fp ^ words[:, j]) * np.uint64(0x9E3779B97F4A7C15)
    _, first, which = _distinct(fp)
    if not (tags == tags[first][which]).all():
        rows = np.ascontiguousarray(tags).view(f"V{tags.shape[1]}").ravel()
        _, first, which = np.unique(rows, return_index=True, return_inverse=True)
    return [tags[i].tobytes() for i in first], which.ravel()


def _one_scalar(
    m: np.ndarray, n: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Rows of an (events, n) byte matrix in the usual layout, per step-varint width k:
    0x09 wall_time(8) 0x10 step(k) 0x2a n-12-k 0x0a tlen+7 0x0a tlen tag(tlen) 0x15 value(4),
    every length one byte. Yields (rows, steps, values, tag matrix) for the rows that match."""
    cont = m[:, 10 : min(n, 20)] >= 0x80
    width = np.argmin(cont, axis=1) + 1  # the first byte without a continuation bit
    width[cont.all(axis=1)] = 0
    for k in np.unique(width).tolist():
        tlen = n - 21 - k
        if k == 0 or k > 9 or tlen < 1 or n - 12 - k > 127:
            continue
        rows = np.flatnonzero(width == k)
        s = m[rows] if len(rows) < len(m) else m
        ok = (
            (s[:, 0] == 0x09)
            & (s[:, 9] == 0x10)
            & (s[:, 10 + k] == 0x2A)
            & (s[:, 11 + k] == n - 12 - k)
            & (s[:, 12 + k] == 0x0A)
            & (s[:, 13 + k] == tlen + 7)
            & (s[:, 14 + k] == 0x0A)
            & (s[:, 15 + k] == tlen)
            & (s[:, n - 5] == 0x15)
        )
        s = s[ok]
        step = np.zeros(len(s), np.int64)
        for j in range(k):
            step |= (s[:, 10 + j].astype(np.int64) & 0x7F) << (7 * j)
        values = np.ascontiguousarray(s[:, n - 4 :]).view("<f4").ravel().astype(np.float64)
        yield rows[ok], step, values, s[:, 16 + k : 16 + k + tlen]


class Records:
    """The complete, verified records of one event file, read from where the last read
    stopped: a record still being written is read once complete; a record whose data fails its
    checksum is skipped and reported; a length that fails its checksum leaves the rest of the
    file unreadable (reported once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.dead = False  # a length failed its checksum: nothing after it can be framed

    def read_scalars(self) -> tuple[Columns, list[tuple[int, str]]]:
        """Every scalar of the new records, per tag in file order, and the problems found
        (byte offset, what)."""
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        problems: list[tuple[int, str]] = []
        chunk = CHUNK
        while not self.dead:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                buf = f.read(chunk)
            starts, size, used, dead = _frame(buf)
            self._columns(buf, starts, size, parts, problems)
            self.offset += used
            if dead:
                self.dead = True
                why = "a record length failed its checksum; the rest of the file is unreadable"
                problems.append((self.offset, why))
                log.error("watch: %s: bad length checksum at byte %d", self.path, self.offset)
            if len(buf) < chunk:
                break  # the end of what is written
            chunk = CHUNK if len(starts) else 2 * chunk  # a record longer than a chunk
        return _columns_of(parts), problems

    def _columns(
        self,
        buf: bytes,
        starts: np.ndarray,
        size: np.ndarray,
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]],
        problems: list[tuple[int, str]],
    ) -> None:
        """Check the data checksums of the framed records and decode them into `parts`, each
        scalar keyed by its byte offset in the file (file order across reads), one group of
        records of one length at a time."""
        arr = np.frombuffer(buf, np.uint8)
        lengths, _, inverse = _distinct(size)
        walk: list[int] = []
        for g, n in enumerate(lengths.tolist()):
            idx = np.flatnonzero(inverse == g)
            data = starts[idx] + 12
            bulk = len(idx) >= 2048 and 23 <= n < 140  # else the tables cost more than calls
            rows = sliding_window_view(arr, n + n % 2)[data] if bulk else None
            stored = _at(arr, data + n, "<u4")
            ok = _checksums(arr, data, n, rows) == stored
            for at in (self.offset + starts[idx[~ok]]).tolist():
                problems.append((at, "a TensorBoard record failed its checksum; skipped"))
                log.error("watch: %s: record at byte %d fails its checksum, skipped", self.path, at)
            if not ok.all():
                idx, data = idx[ok], data[ok]
                rows = rows[ok] if rows is not None else None
            if not 23 <= n < 140:  # not one scalar with one-byte lengths: the walk
                walk.extend(idx.tolist())
                continue
            m = (rows if rows is not None else sliding_window_view(arr, n)[data])[:, :n]
            matched = np.zeros(len(idx), bool)
            for rows, step, values, tags in _one_scalar(m, n):
                matched[rows] = True
                key = (self.offset + starts[idx[rows]]).astype(np.float64)
                names, which = _tag_ids(tags)
                for t, name in enumerate(names):
                    mine = which == t
                    parts.setdefault(name.decode("utf-8", "replace"), []).append(
                        (key[mine], step[mine], values[mine])
                    )
            walk.extend(idx[~matched].tolist())
        view = memoryview(buf)
        for i in walk:
            a, n = int(starts[i]) + 12, int(size[i])
            try:
                found = list(scalars(bytes(view[a : a + n])))
            except EventError as e:
                problems.append((self.offset + a - 12, f"an event that cannot be decoded: {e}"))
                continue
            at = float(self.offset + a - 12)
            for j, (step_, tag, value) in enumerate(found):  # several scalars: in their order
                parts.setdefault(tag, []).append(
                    (
                        np.array([at + j / (len(found) + 1)]),
                        np.array([step_], np.int64),
                        np.array([value], np.float64),
                    )
                )


def _columns_of(parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]) -> Columns:
    """Per tag, its pieces in file order (pieces come in order within a group of records; the
    groups are put in order, and sorted only where they interleave)."""
    out: Columns = {}
    for tag, pieces in parts.items():
        pieces.sort(key=lambda p: p[0][0])
        key = np.concatenate([p[0] for p in pieces])
        steps = np.concatenate([p[1] for p in pieces])
        values = np.concatenate([p[2] for p in pieces])
        if len(key) > 1 and not (key[1:] >= key[:-1]).all():
            i = np.argsort(key, kind="stable")
            steps, values = steps[i], values[i]
        out[tag] = steps, values
    return out
