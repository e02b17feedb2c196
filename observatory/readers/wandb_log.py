"""W&B run files (`wandb/offline-run-*/run-*.wandb`, and the local copy of an online run)
without a W&B server or the `wandb` package.

The file is W&B's transaction log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then
LevelDB's log format. 32 KiB blocks of chunks, each `uint32 CRC-32 (zlib's, of the type byte and
the data), uint16 length, uint8 type` (1 a whole record, 2 / 3 / 4 its first / middle / last
part); fewer than 7 bytes left in a block are padding. A record is a `wandb_internal.Record`
protobuf, decoded here without its schema (observatory/readers/tfevents.py's walk) by the field
numbers of wandb's `wandb_internal.proto`: a history row is Record field 2, its items field 1
(key 1, nested key 2, the value as JSON 16) and its step field 2 (num 1). The test writes with
wandb's own client, so a change of the format fails it.

Read incrementally: a record whose last chunk is not written yet is read on a later poll; a
chunk that fails its checksum is reported and the rest of its block skipped (LevelDB's rule).
History items whose key starts with `_` (`_step`, `_runtime`, `_timestamp`) are W&B's own;
values that are not numbers (media, histograms, text) are not scalars and are skipped.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

from spikewatch.observatory.readers.tfevents import Columns, EventError, _fields

__all__ = ["WandbLog", "WANDB_GLOB"]

WANDB_GLOB = "*.wandb"
HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_CHUNK = struct.Struct("<IHB")
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}


class WandbLog:
    """The complete history rows of one W&B run file, from where the last read stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0  # where the next record's first chunk starts

    def read_scalars(self) -> tuple[Columns, list[tuple[int, str]]]:
        """Every numeric history value of the new records, per key in file order, and the
        problems found (byte offset, what)."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            buf = f.read()
        problems: list[tuple[int, str]] = []
        rows: dict[str, tuple[list[int], list[float]]] = {}
        base, pos = self.offset, 0
        if base == 0:
            if len(buf) < len(HEADER):
                return {}, []
            if buf[: len(HEADER)] != HEADER:
                raise EventError(f"{self.path}: not a W&B run file (header {buf[:7]!r})")
            pos = self.offset = len(HEADER)
        parts: list[bytes] = []
        while True:
            left = BLOCK - (base + pos) % BLOCK
            if left < 7:
                pos += left  # the block's padding
                continue
            if pos + 7 > len(buf):
                break
            crc, n, kind = _CHUNK.unpack_from(buf, pos)
            if kind == 0 and n == 0:  # zeros: preallocated, not written yet
                break
            if pos + 7 + n > len(buf):
                break  # a chunk still being written
            data = buf[pos + 7 : pos + 7 + n]
            if zlib.crc32(data, _TYPE_CRC.get(kind, zlib.crc32(bytes([kind])))) != crc:
                problems.append((base + pos, "a W&B chunk failed its checksum; its block skipped"))
                pos += left
                parts = []
                self.offset = base + pos
                continue
            pos += 7 + n
            if kind == FULL or (kind == LAST and parts):
                record = b"".join([*parts, data])
                parts = []
                self.offset = base + pos
                try:
                    _history(record, rows)
                except EventError as e:
                    problems.append((self.offset, f"a W&B record that cannot be decoded: {e}"))
            elif kind == FIRST:
                parts = [data]
            elif kind == MIDDLE and parts:
                parts.append(data)
            else:  # a middle or last part without its first: dropped, as LevelDB does
                parts = []
                self.offset = base + pos
        columns = {
            tag: (np.array(st, np.int64), np.array(v, np.float64)) for tag, (st, v) in rows.items()
        }
        return columns, problems


def _history(record: bytes, rows: dict[str, tuple[list[int], list[float]]]) -> None:
    """The numeric items of a history row (Record field 2) into `rows`; other records pass."""
    history = next((v for field, _, v in _fields(record) if field == 2), None)
    if history is None:
        return
    step: int | None = None
    items: list[tuple[str, float]] = []
    for field, _, value in _fields(history):
        if field == 2:  # HistoryStep
            step = next((v for f, _, v in _fields(value) if f == 1), 0)
        elif field == 1:  # HistoryItem
            key, nested, text = "", [], None
            for f, _, v in _fields(value):
                if f == 1:
                    key = v.decode("utf-8", "replace")
                elif f == 2:
                    nested.append(v.decode("utf-8", "replace"))
                elif f == 16:
                    text = v
            tag = "/".join(nested) if nested else key
            if tag == "_step" and text is not None:
                step = int(json.loads(text))
            elif tag and not tag.startswith("_") and text is not None:
                number = _number(text)
                if number is not None:
                    items.append((tag, number))
    for tag, number in items:
        steps, values = rows.setdefault(tag, ([], []))
        steps.append(step or 0)
        values.append(number)


def _number(text: bytes) -> float | None:
    """A JSON number (NaN and Infinity as W&B writes them), else None."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
