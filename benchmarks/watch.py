"""`spikewatch watch`: lag from a TensorBoard write to the store, and the import rate.

    python benchmarks/watch.py [--seconds 20] [--scalars 1000000]

Lag: a real `SummaryWriter` writes a loss every 50 ms (flushed, as a trainer's writer does)
while the follower polls every 0.5 s (`spikewatch watch`'s default) into SQLite through the
sink; a reader sees each step's point land. p50 / p95 of (seen - written).

Import: an event file of `--scalars` scalars (10 tags per step, written as TFRecords with their
CRC-32C, like TensorBoard's), imported by one poll into a fresh SQLite store: values/s, the
median of three imports (this machine's noise is ±20% from one to the next).

Restart: the log grows by 10 steps while the watch is down; a new watch with the first one's
saved offsets: seconds from its start until those steps are in the store (read once: checked).

Last line: a JSON object {"lag_p95_s": ..., "import_values_per_s": ..., "restart_live_s": ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text  # noqa: E402

from spikewatch.observatory.readers.follow import Follower  # noqa: E402
from spikewatch.observatory.readers.tfevents import masked_crc  # noqa: E402
from spikewatch.observatory.store import db  # noqa: E402
from spikewatch.observatory.store.sink import DbSink  # noqa: E402


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _event(step: int, tag: str, value: float) -> bytes:
    """An Event{wall_time, step, summary{value{tag, simple_value}}} protobuf."""
    tag_b = tag.encode()
    val = b"\x0a" + _varint(len(tag_b)) + tag_b + b"\x15" + struct.pack("<f", value)
    summary = b"\x0a" + _varint(len(val)) + val
    return (
        b"\x09" + struct.pack("<d", time.time()) + b"\x10" + _varint(step)
        + b"\x2a" + _varint(len(summary)) + summary
    )  # fmt: skip


def _record(data: bytes) -> bytes:
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc(head)) + data + struct.pack("<I", masked_crc(data))


def import_rate(scalars: int, tmp: Path, repeats: int = 3) -> tuple[list[float], float]:
    """(values/s of each of `repeats` imports of one log, each into a fresh store, seconds
    from a restarted watch's start to the new points of the grown log in the store)."""
    logs = tmp / "import" / "run"
    logs.mkdir(parents=True)
    tags = [f"train/loss_{i}" if i else "train/loss" for i in range(10)]
    steps = scalars // len(tags)
    events = logs / "events.out.tfevents.1.bench"
    with open(events, "wb") as f:
        for step in range(steps):
            f.write(b"".join(_record(_event(step, t, 2.0 + 0.001 * step)) for t in tags))
    rates = []
    for r in range(repeats):
        url = f"sqlite:///{tmp / f'import{r}.db'}"
        db.upgrade(url)
        state = tmp / f"watch-state{r}.json"
        sink = DbSink(url, spool_dir=tmp / f"spool-import{r}")
        follower = Follower([tmp / "import"], sink, state_path=state)
        t0 = time.perf_counter()
        n = follower.poll()
        assert sink.flush(600)
        rates.append(n / (time.perf_counter() - t0))
        sink.close()
    with open(events, "ab") as f:  # the run goes on while the watch is down
        for step in range(steps, steps + 10):
            f.write(b"".join(_record(_event(step, t, 2.0 + 0.001 * step)) for t in tags))
    t0 = time.perf_counter()  # a restarted watch: live again once the new steps are stored
    sink = DbSink(url, spool_dir=tmp / f"spool-import{r}")
    again = Follower([tmp / "import"], sink, state_path=state).poll()
    assert sink.flush(600)
    restart = time.perf_counter() - t0
    sink.close()
    assert again == 10 * len(tags), again  # only the new points were read
    engine = db.make_engine(url)
    with engine.connect() as conn:
        stored = conn.execute(text("SELECT SUM(n) FROM point_windows")).scalar()
    engine.dispose()
    assert stored == (steps + 10) * len(tags), stored  # each point once
    return rates, restart


def lag(seconds: float, tmp: Path) -> list[float]:
    from torch.utils.tensorboard import SummaryWriter

    url = f"sqlite:///{tmp / 'lag.db'}"
    db.upgrade(url)
    sink = DbSink(url, spool_dir=tmp / "spool-lag")
    follower = Follower([tmp / "lag"], sink)
    writer = SummaryWriter(str(tmp / "lag" / "run"))
    written: dict[int, float] = {}
    seen: dict[int, float] = {}
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            follower.poll()
            time.sleep(0.5)

    def read() -> None:
        engine = db.make_engine(url)
        with engine.connect() as conn:
            while not stop.is_set():
                top = conn.execute(text("SELECT MAX(last_step) FROM point_windows")).scalar()
                now = time.perf_counter()
                for s in range(0 if not seen else max(seen) + 1, (top or -1) + 1):
                    seen.setdefault(s, now)
                conn.rollback()
                time.sleep(0.02)
        engine.dispose()

    threads = [threading.Thread(target=follow), threading.Thread(target=read)]
    for t in threads:
        t.start()
    step, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        writer.add_scalar("train/loss", 2.0, step)
        writer.flush()
        written[step] = time.perf_counter()
        step += 1
        time.sleep(0.05)
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join()
    writer.close()
    sink.close()
    return [seen[s] - written[s] for s in written if s in seen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--scalars", type=int, default=1_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lags = sorted(lag(args.seconds, Path(tmp)))
        p50 = statistics.median(lags)
        p95 = lags[min(len(lags) - 1, int(0.95 * len(lags)))]
        print(f"lag over {len(lags)} steps: p50 {p50:.3f} s, p95 {p95:.3f} s (goal p95 <= 2 s)")
        rates, restart = import_rate(args.scalars, Path(tmp))
        rate = statistics.median(rates)
        each = ", ".join(f"{r:,.0f}" for r in rates)
        print(f"import of {args.scalars:,} scalars: median {rate:,.0f} values/s ({each})")
        print(f"a restarted watch on that log stores the new steps after {restart:.2f} s")
    out = {"lag_p95_s": round(p95, 3), "import_values_per_s": round(rate)}
    print(json.dumps(out | {"restart_live_s": round(restart, 2)}))


if __name__ == "__main__":
    main()
