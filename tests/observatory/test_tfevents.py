"""The bulk TensorBoard reader reads exactly what a record-by-record reader reads.

The reference here frames one record at a time with `struct`, checks both checksums with the
`crc32c` package and decodes each event with the protobuf walk: the way the watch read event files
before it read them in bulk. Files come from torch's own SummaryWriter, and from raw records where
a test needs a corrupt, torn or odd one."""

import random
import struct

import crc32c
import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from spikewatch.observatory.readers.tfevents import (
    Records,
    _checksums,
    _frame,
    masked_crc,
    walk_scalars,
)


def value(tag: bytes, v: float) -> bytes:
    """A Summary.Value{tag, simple_value}, its field in the summary included."""
    body = b"\x0a" + bytes([len(tag)]) + tag + b"\x15" + struct.pack("<f", v)
    return b"\x0a" + bytes([len(body)]) + body


def reference(buf: bytes) -> tuple[dict[str, tuple[list, list]], int, bool]:
    """Scalars per tag in file order, the bytes of complete records, whether a length failed."""
    out: dict[str, tuple[list, list]] = {}
    pos = 0
    while pos + 12 <= len(buf):
        (n,), (crc_len,) = (
            struct.unpack_from("<Q", buf, pos),
            struct.unpack_from("<I", buf, pos + 8),
        )
        if masked_crc(buf[pos : pos + 8]) != crc_len:
            return out, pos, True
        if pos + 16 + n > len(buf):
            break
        data = buf[pos + 12 : pos + 12 + n]
        if masked_crc(data) == struct.unpack_from("<I", buf, pos + 12 + n)[0]:
            try:
                for step, tag, value in walk_scalars(data):
                    out.setdefault(tag, ([], []))[0].append(step)
                    out[tag][1].append(value)
            except ValueError:
                pass
        pos += 16 + n
    return out, pos, False


def same(got, want) -> None:
    assert sorted(got) == sorted(want)
    for tag, (steps, values) in want.items():
        assert got[tag][0].tolist() == steps, tag
        assert got[tag][1].tolist() == values, tag


def record(data: bytes) -> bytes:
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc(head)) + data + struct.pack("<I", masked_crc(data))


def event(step: int, tag: str, value: float, wall: float = 1.7e9) -> bytes:
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            b, n = n & 0x7F, n >> 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return bytes(out)

    t = tag.encode()
    val = b"\x0a" + varint(len(t)) + t + b"\x15" + struct.pack("<f", value)
    summary = b"\x0a" + varint(len(val)) + val
    return (
        b"\x09" + struct.pack("<d", wall) + b"\x10" + varint(step)
        + b"\x2a" + varint(len(summary)) + summary
    )  # fmt: skip


@pytest.fixture(scope="module")
def writer_file(tmp_path_factory):
    """A real SummaryWriter log: 3,000 steps (the bulk path), varint widths 1-5, tags of many
    lengths (one past a one-byte length, one not ASCII), text and histograms between."""
    d = tmp_path_factory.mktemp("tb")
    w = SummaryWriter(str(d))
    tags = ["loss", "train/loss", "grad_norm", "x" * 130, "ünïcode/täg"]
    steps = [*range(3000), 16_383, 16_384, 2**21, 2**31 - 1]
    for step in steps:
        for i, tag in enumerate(tags[:3] if step % 50 else tags):
            w.add_scalar(tag, 1.5 + i + step * 1e-3, step)
        if step % 700 == 0:
            w.add_text("note", "not a scalar", step)
            w.add_histogram("h", np.arange(10.0), step)
    w.close()
    (path,) = d.glob("events.out.tfevents.*")
    return path


def test_a_summary_writer_log_reads_as_record_by_record(writer_file):
    got, problems = Records(writer_file).read_scalars()
    want, _, _ = reference(writer_file.read_bytes())
    same(got, want)
    assert problems == [] and len(got["loss"][0]) == 3004


def test_read_in_pieces_as_it_is_written(writer_file, tmp_path):
    """Cut anywhere (inside a header, inside data, between records): each read takes the
    complete records, the next read goes on from there, and together they read the whole."""
    buf = writer_file.read_bytes()
    path = tmp_path / writer_file.name
    records = Records(path)
    parts: dict[str, tuple[list, list]] = {}
    cuts = sorted(random.Random(0).sample(range(len(buf)), 12)) + [len(buf)]
    with open(path, "wb") as f:
        done = 0
        for cut in cuts:
            f.write(buf[done:cut])
            f.flush()
            done = cut
            for tag, (steps, values) in records.read_scalars()[0].items():
                parts.setdefault(tag, ([], []))[0].extend(steps.tolist())
                parts[tag][1].extend(values.tolist())
    want, _, _ = reference(buf)
    same({t: (np.array(s), np.array(v)) for t, (s, v) in parts.items()}, want)
    assert records.offset == len(buf)


def test_a_corrupt_record_is_skipped_and_a_bad_length_ends_the_file(tmp_path):
    rng = random.Random(1)
    recs = [record(event(s, f"t{s % 3}", rng.random())) for s in range(5000)]
    at = [sum(map(len, recs[:i])) for i in (1000, 3000)]
    buf = bytearray(b"".join(recs))
    buf[at[0] + 20] ^= 0xFF  # inside the data of record 1000
    buf[at[1] + 2] ^= 0x01  # the length of record 3000
    path = tmp_path / "events.out.tfevents.1.x"
    path.write_bytes(bytes(buf))
    records = Records(path)
    got, problems = records.read_scalars()
    want, end, dead = reference(bytes(buf))
    same(got, want)
    assert dead and records.dead and records.offset == end == at[1]
    assert [p for p, _ in problems] == at
    assert "checksum" in problems[0][1] and "rest of the file" in problems[1][1]
    assert records.read_scalars() == ({}, [])  # nothing after a bad length, and said once


def test_odd_records_take_the_walk_and_the_rest_stays_fast(tmp_path):
    """Events in another field order, several values in one summary, a record that is no
    protobuf at all, and data holding false record headers (bytes that look like a record
    start whose length points at another such look-alike): same as record by record."""
    rng = np.random.default_rng(2)
    fake = struct.pack("<Q", 40) + b"\0\0\0\0" + b"\x09"  # a header-like run of bytes
    out = []
    for s in range(6000):
        if s % 997 == 5:  # step before wall_time
            out.append(
                record(b"\x10" + bytes([s % 100]) + b"\x09" + bytes(8) + event(0, "a", 1)[10 + 1 :])
            )
        elif s % 1001 == 7:  # two values in one event
            summary = value(b"p", 1.0) + value(b"q", 2.0)
            out.append(
                record(
                    b"\x09"
                    + bytes(8)
                    + b"\x10"
                    + bytes([s % 128])
                    + b"\x2a"
                    + bytes([len(summary)])
                    + summary
                )
            )
        elif s % 1009 == 11:  # not a protobuf: look-alike headers, 40 bytes apart
            out.append(record(b"\x09" + (fake + bytes(40 + 16 - len(fake))) * 3))
        else:
            out.append(record(event(s, "loss", float(rng.standard_normal()), float(rng.random()))))
    buf = b"".join(out)
    path = tmp_path / "events.out.tfevents.1.y"
    path.write_bytes(buf)
    got, problems = Records(path).read_scalars()
    want, end, _ = reference(buf)
    same(got, want)
    assert {"p", "q", "a", "loss"} <= set(got)
    assert all("cannot be decoded" in what for _, what in problems) and len(problems) == 6
    starts, size, used, dead = _frame(buf)
    assert used == end == len(buf) and not dead and len(starts) == 6000


@pytest.mark.parametrize("n", [23, 24, 49, 50, 139])
def test_bulk_checksums_are_crc32c(n):
    rng = np.random.default_rng(n)
    arr = rng.integers(0, 256, 5000 * (n + 5), dtype=np.uint8)
    data = np.arange(5000) * (n + 5)
    rows = np.lib.stride_tricks.sliding_window_view(arr, n + n % 2)[data]
    want = [masked_crc(arr[a : a + n].tobytes()) for a in data.tolist()]
    assert _checksums(arr, data, n, rows).tolist() == want
    assert _checksums(arr, data, n, None).tolist() == want
    assert crc32c.crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
