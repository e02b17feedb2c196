"""The packed store (observatory/store/chunks.py, the writer's window logic): every value exactly
once, whatever order and batching it arrives in, checked against a plain dict of what was sent."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from sqlalchemy import text

from spikewatch.observatory import store
from spikewatch.observatory.store import db
from spikewatch.observatory.store.chunks import WINDOW, decode, encode
from spikewatch.observatory.store.ingest import Writer
from spikewatch.observatory.store.records import Record

from .helpers import assert_windows_consistent, count, stored_points

NAMES = ("train/loss", "optim/lr", "layer/3/attn/grad_norm", "layer/3/head/7/attn_max")


def _value(rng: np.random.Generator, name: str, step: int) -> float:
    if rng.random() < 0.03:
        return float(rng.choice([math.nan, math.inf, -math.inf]))
    if name == "optim/lr":  # not a float32 number: must come back to the last bit
        return 1e-3 * math.cos(step / 97.0)
    return float(np.float32(rng.standard_normal() + step / 100))


def test_random_batches_store_the_first_value_of_every_step_exactly_once(db_url: str) -> None:
    """Batches that cross windows, repeat steps (replays, resumes), go back in time and leave
    gaps, written by writers that come and go: the store holds the first value sent for every
    (series, step), each window's summary is right, and every series has one tail row, its
    newest window."""
    rng = np.random.default_rng(7)
    engine = db.make_engine(db_url, writer=True)
    writer = Writer(engine)
    writer.write([Record("run", "w", {"status": "running", "config": {}, "tags": []})])
    first: dict[tuple[str, int], float] = {}
    step = 0
    for i in range(60):
        if rng.random() < 0.15:  # a resume or a replay: back to an earlier step
            step = max(0, step - int(rng.integers(1, 700)))
        size = int(rng.choice([1, 3, 40, 300, 900]))
        steps = [s for s in range(step, step + size) if rng.random() > 0.05]  # some gaps
        records = []
        for s in steps:
            values = {n: _value(rng, n, s) for n in NAMES if n != "optim/lr" or s % 3 == 0}
            for n, v in values.items():
                first.setdefault((n, s), v)
            records.append(Record("metrics", "w", {"branch": 0, "step": s, "values": values}))
        writer.write(records)
        step += size
        if i % 11 == 10:
            writer = Writer(engine)  # a new process: nothing cached
        if i % 17 == 16:  # the run ends (on PostgreSQL its tails join the other windows)
            writer.write([Record("status", "w", {"status": "completed"})])
            if engine.dialect.name == "postgresql":
                assert count(engine, "SELECT COUNT(*) FROM point_tails") == 0
    with engine.connect() as conn:
        names = dict(
            conn.execute(
                text(
                    "SELECT s.id, m.name || ':' || s.layer || ':' || s.head FROM series s "
                    "JOIN metric_names m ON m.id = s.metric_id"
                )
            ).all()
        )
    by_template = {
        "train/loss:-1:-1": "train/loss",
        "optim/lr:-1:-1": "optim/lr",
        "layer/*/attn/grad_norm:3:-1": "layer/3/attn/grad_norm",
        "layer/*/head/*/attn_max:3:7": "layer/3/head/7/attn_max",
    }
    got = {(by_template[names[sid]], s): v for sid, s, v in stored_points(engine)}
    assert len(got) == len(stored_points(engine))  # no step twice
    assert got.keys() == first.keys()
    for key, want in first.items():
        assert got[key] == want or (math.isnan(got[key]) and math.isnan(want)), key
    assert_windows_consistent(engine)
    assert count(engine, "SELECT COUNT(*) FROM point_tails") <= len(NAMES)
    assert (
        count(
            engine,
            "SELECT COUNT(*) FROM point_chunks c JOIN point_tails t ON t.series_id = c.series_id "
            "WHERE c.win >= t.win",
        )
        == 0
    )
    with store.session_factory(engine=engine)() as session:
        (s,) = store.series(session, run_id="w", metric="optim/lr", buckets=5)
        assert sum(b.n for b in s.buckets) == sum(1 for n, _ in first if n == "optim/lr")
    engine.dispose()


def test_a_window_round_trips_bit_for_bit_and_picks_the_narrowest_exact_type() -> None:
    steps = np.array([3, 4, 5, 9, 511], np.int64)
    f32 = np.array([1.5, np.nan, np.inf, -np.inf, 0.1], np.float32).astype(np.float64)
    row = encode(1, steps, f32)
    st, v = decode(row[1], row[2], row[3], row[4], row[-2], row[-1])
    assert st.tolist() == steps.tolist() and np.array_equal(v, f32, equal_nan=True)
    assert row[-2] is not None  # steps are not contiguous: stored
    f64 = f32.copy()
    f64[4] = 0.1  # a float64 value: the window is stored as float64, nothing rounded
    wide = encode(1, steps, f64)
    assert decode(wide[1], wide[2], wide[3], wide[4], wide[-2], wide[-1])[1][4] == 0.1
    contiguous = encode(2, np.arange(WINDOW, 2 * WINDOW), np.zeros(WINDOW))
    assert contiguous[1] == 1 and contiguous[-2] is None
    # summary: n, NaNs, first NaN, min/max with the earliest step of ties
    assert row[4:11] == (5, 1, 4, -math.inf, 9, math.inf, 5)


@pytest.mark.parametrize("batch", [1, 37, 600])
def test_a_series_moving_on_leaves_one_tail_row(sqlite_url: str, batch: int) -> None:
    engine = db.make_engine(sqlite_url, writer=True)
    writer = Writer(engine)
    for a in range(0, 3 * WINDOW + 5, batch):
        steps = np.arange(a, min(a + batch, 3 * WINDOW + 5))
        writer.write_series("t", 0, "train/loss", steps, steps.astype(float))
    assert count(engine, "SELECT COUNT(*) FROM point_chunks") == 3
    assert count(engine, "SELECT win FROM point_tails") == 3
    assert [s for _, s, _ in stored_points(engine)] == list(range(3 * WINDOW + 5))
    assert_windows_consistent(engine)


def test_windows_decode_right_from_many_threads_at_once() -> None:
    """The dashboard serves requests from a thread pool: zstd's objects are per thread."""
    rng = np.random.default_rng(1)
    rows = [encode(i, np.arange(WINDOW), rng.standard_normal(WINDOW)) for i in range(64)]
    want = [decode(r[1], r[2], r[3], r[4], r[-2], r[-1])[1] for r in rows]

    def work(_: int) -> bool:
        again = [encode(r[0], *decode(r[1], r[2], r[3], r[4], r[-2], r[-1])) for r in rows]
        return again == rows and all(
            np.array_equal(decode(r[1], r[2], r[3], r[4], r[-2], r[-1])[1], w)
            for r, w in zip(rows, want, strict=True)
        )

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(64)))
