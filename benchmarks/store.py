"""Observatory store figures on SQLite and the local PostgreSQL (issue 5's numbers).

For each backend, in a fresh database (SQLite file in a temp dir; a new PostgreSQL schema,
dropped afterwards):

- ingest: a simulated run logs 500 values per step (48 layers x 10 metrics + 20 scalars) through
  `DbSink` as fast as the caller can; values/s from the first enqueue until `flush()` says all
  is committed (the writer's sustained rate: the producer is far faster).
- enqueue latency while the writer is busy: with a backlog queued, a loop that "computes" 2 ms
  per step (a sleep: like torch kernels it releases the GIL) then logs 500 values; only calls
  made while the writer still had work queued count. The same statistic for a tight loop (no
  compute, the worst case for the GIL) is printed too.
- query: a 1M-point series (bulk-loaded) downsampled to 2,000 buckets, p50/p95 over repeats;
  the same reduction over every decoded value (no stored summaries) is timed interleaved as
  the baseline.
- heatmap: 48 layers x 20,000 steps to 1,000 step buckets (`layer_matrix`), p95.

    python benchmarks/store.py [--pg-url URL] [--ingest-values 1500000] [--reps 20]

Last line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine  # noqa: E402
from sqlalchemy import text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from spikewatch.observatory import store
from spikewatch.observatory.store import db  # noqa: E402
from spikewatch.observatory.store.chunks import decode, reduce_points  # noqa: E402
from spikewatch.observatory.store.ingest import Writer  # noqa: E402
from spikewatch.observatory.store.records import Record  # noqa: E402
from spikewatch.observatory.store.sink import DbSink  # noqa: E402

NAMES = [f"layer/{layer}/m{j}" for layer in range(48) for j in range(10)]
NAMES += [f"train/s{j}" for j in range(20)]
TARGETS = {"ingest": 200_000, "enqueue_p99_ms": 0.5, "query_p95_ms": 100.0, "heatmap_ms": 300.0}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def step_values(rng: np.random.Generator, step: int) -> dict[str, float]:
    return dict(zip(NAMES, (rng.random(len(NAMES)) + step).tolist(), strict=True))


def bench_ingest(url: str, spool: Path, n_values: int) -> tuple[float, list[float]]:
    """Values/s through the sink until flushed; enqueue latencies (ms) of a tight loop."""
    steps = n_values // len(NAMES)
    rng = np.random.default_rng(0)
    payload = [step_values(rng, s) for s in range(steps)]
    sink = DbSink(url, spool_dir=spool, queue_size=steps + 16)
    sink.start_run("bench-ingest")
    assert sink.flush(60)
    lat = []
    t0 = time.perf_counter()
    for step, values in enumerate(payload):
        a = time.perf_counter()
        sink.log_metrics("bench-ingest", 0, step, values)
        lat.append((time.perf_counter() - a) * 1e3)
    assert sink.flush(600), "ingest did not finish"
    elapsed = time.perf_counter() - t0
    sink.close()
    assert sink.stats["overflow"] == 0 and sink.stats["spooled"] == 0, sink.stats
    return steps * len(NAMES) / elapsed, lat


def bench_enqueue(url: str, spool: Path, seconds: float = 3.0) -> tuple[list[float], float]:
    """Latency (ms) of log_metrics in a 2 ms/step loop while the writer has a backlog."""
    rng = np.random.default_rng(1)
    payload = [step_values(rng, s) for s in range(4000)]
    sink = DbSink(url, spool_dir=spool, queue_size=100_000)
    sink.start_run("bench-enqueue")
    for step in range(2000):  # ~1M values of backlog
        sink.log_metrics("bench-enqueue", 0, step, payload[step % 4000])
    lat, busy_calls, step = [], 0, 2000
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        time.sleep(0.002)  # the training step's compute (releases the GIL)
        busy = sink.queued > 0  # the benchmark checks the writer is busy
        a = time.perf_counter()
        sink.log_metrics("bench-enqueue", 0, step, payload[step % 4000])
        if busy:
            lat.append((time.perf_counter() - a) * 1e3)
            busy_calls += 1
        step += 1
    sink.flush(600)
    sink.close()
    return lat, busy_calls / max(1, step - 2000)


def timed(fn, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(reps):
        a = time.perf_counter()
        fn()
        out.append((time.perf_counter() - a) * 1e3)
    return out


def bench_query(url: str, reps: int) -> dict[str, float]:
    engine = db.make_engine(url, writer=True)
    writer = Writer(engine)
    writer.write([Record("run", "bench-query", {"status": "running", "config": {}, "tags": []})])
    rng = np.random.default_rng(2)
    n = 1_000_000
    values = 2 + 0.1 * rng.standard_normal(n)
    values[654_321] = 1e4  # a one-step spike
    writer.write_series("bench-query", 0, "train/loss", np.arange(n), values)
    sessions = store.session_factory(engine=db.make_engine(url))

    def query() -> None:
        with sessions() as s:
            (res,) = store.series(s, run_id="bench-query", metric="train/loss", buckets=2000)
            top = max(res.buckets, key=lambda b: b.max_value or 0)
            assert (top.max_value, top.max_step) == (1e4, 654_321) and len(res.buckets) <= 2000

    with sessions() as s:
        sid = s.execute(text("SELECT id FROM series ORDER BY id DESC LIMIT 1")).scalar_one()
    raw_sql = (
        "SELECT win, first_step, last_step, n, steps, vals FROM point_windows "
        f"WHERE series_id = {sid}"
    )

    def raw() -> None:  # the baseline: decode every window, no stored summaries
        with sessions() as s:
            rows = s.connection().exec_driver_sql(raw_sql).all()
            st, v = (np.concatenate(a) for a in zip(*(decode(*r) for r in rows), strict=True))
            b = reduce_points(np.zeros(len(st), np.int64), st, v, 512)
            assert len(b.n) == -(-n // 512)

    query()  # warm the cache, as a dashboard would be
    fast, slow = [], []
    for _ in range(3):  # interleaved with the no-rollup baseline
        fast += timed(query, max(1, reps // 3))
        slow += timed(raw, 1)
    return {
        "query_p50_ms": pct(fast, 50),
        "query_p95_ms": pct(fast, 95),
        "raw_scan_median_ms": statistics.median(slow),
        "speedup_vs_raw_scan": statistics.median(slow) / statistics.median(fast),
    }


def bench_heatmap(url: str, reps: int) -> dict[str, float]:
    writer = Writer(db.make_engine(url, writer=True))
    writer.write([Record("run", "bench-heat", {"status": "running", "config": {}, "tags": []})])
    rng = np.random.default_rng(3)
    steps = np.arange(20_000)
    for layer in range(48):
        writer.write_series(
            "bench-heat", 0, f"layer/{layer}/grad_norm", steps, rng.random(len(steps)) + layer
        )
    sessions = store.session_factory(engine=db.make_engine(url))

    def heat(buckets: int) -> None:
        with sessions() as s:
            m = store.layer_matrix(
                s, run_id="bench-heat", metric="layer/*/grad_norm", buckets=buckets
            )
            assert len(m.rows) == 48 and len(m.starts) <= buckets

    heat(1000)
    t1000 = timed(lambda: heat(1000), reps)
    t2000 = timed(lambda: heat(2000), max(3, reps // 4))
    return {
        "heatmap_p50_ms": pct(t1000, 50),
        "heatmap_p95_ms": pct(t1000, 95),
        "heatmap_2000_p95_ms": pct(t2000, 95),
    }


def backend(name: str, url: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    db.upgrade(url)
    ingest, tight = bench_ingest(url, tmp / f"{name}-spool-a", args.ingest_values)
    print(f"[{name}] ingest {ingest:,.0f} values/s ({args.ingest_values:,} values, 500/step)")
    busy, busy_share = bench_enqueue(url, tmp / f"{name}-spool-b")
    print(
        f"[{name}] enqueue while the writer is busy: p50 {pct(busy, 50):.3f} ms, "
        f"p99 {pct(busy, 99):.3f} ms, max {max(busy):.3f} ms over {len(busy)} calls "
        f"({busy_share:.0%} of calls had a backlog); tight loop p99 {pct(tight, 99):.3f} ms"
    )
    q = bench_query(url, args.reps)
    print(
        f"[{name}] 1M-point series -> 2000 buckets: p50 {q['query_p50_ms']:.1f} ms, "
        f"p95 {q['query_p95_ms']:.1f} ms; "
        f"decode-everything baseline {q['raw_scan_median_ms']:.0f} ms "
        f"({q['speedup_vs_raw_scan']:.0f}x)"
    )
    h = bench_heatmap(url, args.reps)
    print(
        f"[{name}] 48 x 20k heatmap -> 1000 buckets: p50 {h['heatmap_p50_ms']:.1f} ms, "
        f"p95 {h['heatmap_p95_ms']:.1f} ms (2000 buckets: p95 {h['heatmap_2000_p95_ms']:.0f} ms)"
    )
    return {
        "ingest_values_per_s": ingest,
        "enqueue_p50_ms": pct(busy, 50),
        "enqueue_p99_ms": pct(busy, 99),
        "enqueue_max_ms": max(busy),
        "enqueue_p99_ms_tight_loop": pct(tight, 99),
        **q,
        **h,
    }


def pg_schema(base: str) -> tuple[str, object]:
    schema = f"sw_bench_{uuid.uuid4().hex[:8]}"
    admin = db.make_engine(base)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')

    def drop() -> None:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()

    url = make_url(db.resolve_url(base)).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False), drop


def main() -> None:
    default_pg = os.environ.get(
        "SPIKEWATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    )
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pg-url", default=default_pg, help="PostgreSQL server (a new schema is used)")
    p.add_argument("--ingest-values", type=int, default=1_500_000)
    p.add_argument("--reps", type=int, default=21)
    args = p.parse_args()
    print(json.dumps({"machine": machine(), "load_avg_1m": os.getloadavg()[0]}))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["sqlite"] = backend("sqlite", f"sqlite:///{tmp}/bench.db", args, Path(tmp))
        url, drop = pg_schema(args.pg_url)
        try:
            results["pg"] = backend("pg", url, args, Path(tmp))
        finally:
            drop()  # type: ignore[operator]
    s, g = results["sqlite"], results["pg"]
    out = {
        "sqlite_ingest_values_per_s": round(s["ingest_values_per_s"]),
        "pg_ingest_values_per_s": round(g["ingest_values_per_s"]),
        "enqueue_p99_ms": round(max(s["enqueue_p99_ms"], g["enqueue_p99_ms"]), 4),
        "sqlite_query_p95_ms": round(s["query_p95_ms"], 2),
        "pg_query_p95_ms": round(g["query_p95_ms"], 2),
        "heatmap_query_ms": round(max(s["heatmap_p95_ms"], g["heatmap_p95_ms"]), 2),
        "heatmap_buckets": 1000,
        "details": {k: {m: round(v, 4) for m, v in r.items()} for k, r in results.items()},
    }
    out["targets_met"] = {
        "sqlite_ingest": out["sqlite_ingest_values_per_s"] >= TARGETS["ingest"],
        "pg_ingest": out["pg_ingest_values_per_s"] >= TARGETS["ingest"],
        "enqueue_p99": out["enqueue_p99_ms"] <= TARGETS["enqueue_p99_ms"],
        "sqlite_query_p95": out["sqlite_query_p95_ms"] <= TARGETS["query_p95_ms"],
        "pg_query_p95": out["pg_query_p95_ms"] <= TARGETS["query_p95_ms"],
        "heatmap": out["heatmap_query_ms"] <= TARGETS["heatmap_ms"],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
