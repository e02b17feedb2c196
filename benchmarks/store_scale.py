"""The store at a 70B model's shape (issue 18): 80 layers x 64 heads, every value every step.

A simulated run writes, every step, the per-head attention maximum of every head (80 x 64), ten
per-layer statistics (800) and twenty scalars: 5,940 values per step. They go through the real
sink (`DbSink`: queue, writer thread, the same batches a trainer's records make) into a fresh
SQLite file and a fresh PostgreSQL schema. The values are float32 numbers where the trainer's
probes compute float32 (every per-layer and per-head statistic, the loss), float64 where it
computes in Python (the learning rate, tokens/s); they drift slowly and are noisy step to step
(attention maxima: 3% per step), so compression has only real redundancy to find. One head has
a one-step spike and one scalar a NaN, and the queries must show both.

Per backend it reports:

- bytes on disk per stored value of the finished run: the SQLite file after a WAL checkpoint;
  PostgreSQL's `pg_total_relation_size` of every table of the schema (heap, TOAST, indexes),
  after a plain `VACUUM` (autovacuum's work: it frees dead rows for reuse and gives back only
  empty pages at a table's end). The size while the run was still going is printed too: each
  series' newest window is rewritten in place until it is full, a fixed cost per series;
- ingest: values/s from the first `log_metrics` until `flush()` says everything is committed,
  with the producer held at most 512 steps ahead (a trainer that is faster than its writer);
- p95 of the layer x step heatmap of a per-layer statistic over the whole run at 1,000 buckets,
  of one layer's head x step heatmap at 1,000 buckets, and of a scalar series at 2,000 buckets;
- the database size of a 100k-step run, projected linearly.

    python benchmarks/store_scale.py [--steps 2000] [--layers 80] [--heads 64] [--reps 20]
        [--pg-url URL] [--backends sqlite,pg]

Last line: a JSON object with `sqlite_bytes_per_value`, `pg_bytes_per_value`,
`sqlite_ingest_values_per_s`, `pg_ingest_values_per_s`, and `heatmap_p95_ms`,
`head_heatmap_p95_ms`, `series_p95_ms` (the worse backend for each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import machine  # noqa: E402
from store import pct, pg_schema, timed  # noqa: E402

from spikewatch.observatory import metric_names as M  # noqa: E402
from spikewatch.observatory import store
from spikewatch.observatory.store import db  # noqa: E402
from spikewatch.observatory.store.sink import DbSink  # noqa: E402

RUN = "scale"
LAYER_STATS = [
    M.STAT_ATTN_MAX,
    *(
        f"{part}/{stat}"
        for stat in (M.STAT_GRAD_NORM, M.STAT_PARAM_NORM, M.STAT_UPDATE_RATIO)
        for part in ("attn", "mlp")
    ),
    f"attn/{M.STAT_ADAM_SQRT_V_MEAN}",
    f"mlp/{M.STAT_ADAM_SQRT_V_MEAN}",
    f"attn/{M.STAT_ADAM_V_TINY_FRAC}",
]
SCALARS = [M.LOSS, M.CE, M.Z_MEAN, M.LOGIT_MAX, M.GRAD_NORM, M.CLIP_FACTOR, M.LR]
SCALARS += [M.TOKENS_PER_S, *(f"train/extra_{j}" for j in range(20 - len(SCALARS) - 1))]
HEAT_METRIC = M.template(M.STAT_GRAD_NORM, "attn")
GOALS = {"bytes_per_value": 4.0, "ingest": 1e6, "heatmap_ms": 300.0, "series_ms": 100.0}


class Simulation:
    """Per-step values of a model of `layers` x `heads`, deterministic per seed."""

    def __init__(self, layers: int, heads: int, steps: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.layers, self.heads, self.steps = layers, heads, steps
        self.names = [M.attn_max(i, h) for i in range(layers) for h in range(heads)]
        self.names += [M.layer(str(i), s) for i in range(layers) for s in LAYER_STATS]
        self.names += SCALARS
        self.base = self.rng.uniform(3, 25, (layers, heads))
        self.walk = np.zeros((layers, heads))
        self.param = np.full((layers, 2), 50.0)
        self.spike = (steps * 2 // 3, layers // 2, heads // 3)  # step, layer, head
        self.nan_step = steps // 3

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """Every step's values, made before the clock starts (the trainer's compute, which
        does not hold the GIL, is not what is measured): float32 rows and float64 scalars."""
        rows = [self._values(step) for step in range(self.steps)]
        f32 = np.stack([r[0] for r in rows])
        f64 = np.array([r[1] for r in rows], np.float64)
        return f32, f64

    def values(self, f32: np.ndarray, f64: np.ndarray, step: int) -> dict[str, float]:
        flat = [*f32[step].tolist(), *f64[step].tolist()]
        return dict(zip(self.names, flat, strict=True))

    def _values(self, step: int) -> tuple[np.ndarray, list[float]]:
        r, L = self.rng, self.layers
        self.walk += r.normal(0, 0.003, self.walk.shape)
        heads = self.base * np.exp(self.walk) * (1 + 0.03 * r.standard_normal(self.walk.shape))
        if step == self.spike[0]:
            heads[self.spike[1], self.spike[2]] *= 40
        heads = heads.astype(np.float32)
        decay = 1 / math.sqrt(1 + step / 500)
        self.param += np.abs(r.normal(0, 1e-3, self.param.shape))
        stats = np.column_stack(
            [
                heads.max(axis=1),
                0.5 * decay * np.exp(0.2 * r.standard_normal((L, 2))),
                self.param,
                1e-3 * np.exp(0.1 * r.standard_normal((L, 2))),
                1e-4 * np.exp(0.05 * r.standard_normal((L, 2))),
                r.binomial(1_000_000, 0.01, L) / 1e6,
            ]
        ).astype(np.float32)
        loss = np.float32(3.0 * decay + 0.05 * r.standard_normal())
        small = r.standard_normal(len(SCALARS) - 2).astype(np.float32) + np.float32(loss)
        scalars = [
            *small.tolist(),
            3e-4 * math.cos(step / self.steps),
            1e5 * (1 + 0.02 * r.random()),
        ]
        if step == self.nan_step:
            scalars[0] = math.nan
        return np.concatenate([heads.ravel(), stats.ravel()]), scalars


def db_bytes(url: str) -> int:
    engine = db.make_engine(url).execution_options(isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                path = Path(engine.url.database or "")
                return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
            conn.exec_driver_sql("VACUUM")
            return int(
                conn.exec_driver_sql(
                    "SELECT SUM(pg_total_relation_size(c.oid)) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = current_schema() AND c.relkind = 'r'"
                ).scalar_one()
            )
    finally:
        engine.dispose()


def ingest(url: str, spool: Path, sim: Simulation) -> tuple[float, int, int]:
    f32, f64 = sim.table()
    sink = DbSink(url, spool_dir=spool)
    sink.start_run(RUN, name="70B-shaped")
    assert sink.flush(60)
    t0 = time.perf_counter()
    for step in range(sim.steps):
        while sink.queued > 512:  # hold the producer a little ahead
            time.sleep(0.001)
        sink.log_metrics(RUN, 0, step, sim.values(f32, f64, step))
    assert sink.flush(3600), "ingest did not finish"
    elapsed = time.perf_counter() - t0
    running = db_bytes(url)
    sink.set_status(RUN, "completed")  # the run ends: its tail windows join the others
    sink.close()
    assert sink.stats["overflow"] == 0 and sink.stats["spooled"] == 0, sink.stats
    n = sim.steps * len(sim.names)
    return n / elapsed, n, running


def queries(url: str, sim: Simulation, reps: int) -> dict[str, float]:
    sessions = store.session_factory(engine=db.make_engine(url))
    step, layer, head = sim.spike

    def heat() -> None:
        with sessions() as s:
            m = store.layer_matrix(s, run_id=RUN, metric=HEAT_METRIC, buckets=1000)
            assert len(m.rows) == sim.layers and len(m.starts) <= 1000

    def head_heat() -> None:
        with sessions() as s:
            m = store.head_matrix(
                s, run_id=RUN, metric=M.HEAD_ATTN_MAX, layer=layer, buckets=1000, extremes="max"
            )
            assert len(m.rows) == sim.heads
            j = max(range(len(m.starts)), key=lambda k: m.max_value[head][k] or 0)
            assert m.max_step[head][j] == step, "the one-step spike is lost"

    def series() -> None:
        with sessions() as s:
            (res,) = store.series(s, run_id=RUN, metric=M.LOSS, buckets=2000)
            assert sum(b.n_nan for b in res.buckets) == 1 and len(res.buckets) <= 2000

    out: dict[str, list[float]] = {"heatmap": [], "head_heatmap": [], "series": []}
    for fn in (heat, head_heat, series):
        fn()  # warm, as a dashboard's first paint would
    for _ in range(reps):  # interleaved: the machine's noise hits all three alike
        out["heatmap"] += timed(heat, 1)
        out["head_heatmap"] += timed(head_heat, 1)
        out["series"] += timed(series, 1)
    return {f"{k}_p95_ms": pct(v, 95) for k, v in out.items()} | {
        f"{k}_p50_ms": pct(v, 50) for k, v in out.items()
    }


def backend(name: str, url: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    db.upgrade(url)
    empty = db_bytes(url)
    sim = Simulation(args.layers, args.heads, args.steps)
    rate, n, running = ingest(url, tmp / f"{name}-spool", sim)
    size = db_bytes(url) - empty
    per = size / n
    projected = per * len(sim.names) * 100_000
    print(
        f"[{name}] {n:,} values ({len(sim.names)} per step x {args.steps} steps): "
        f"{size / 2**20:,.1f} MiB, {per:.2f} bytes/value; ingest {rate:,.0f} values/s; "
        f"100k steps -> {projected / 2**30:.1f} GiB; while running "
        f"{(running - empty) / 2**20:,.1f} MiB (the newest window of each series is rewritten "
        "in place until it is full: a fixed cost per series, not per step)"
    )
    q = queries(url, sim, args.reps)
    print(
        f"[{name}] p95: layer heatmap {q['heatmap_p95_ms']:.1f} ms, head heatmap "
        f"{q['head_heatmap_p95_ms']:.1f} ms, series {q['series_p95_ms']:.1f} ms"
    )
    return {"bytes_per_value": per, "ingest_values_per_s": rate, "gib_100k": projected / 2**30, **q}


def main() -> None:
    default_pg = os.environ.get(
        "SPIKEWATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    )
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--pg-url", default=default_pg, help="PostgreSQL server (a new schema is used)")
    p.add_argument("--backends", default="sqlite,pg")
    args = p.parse_args()
    print(json.dumps({"machine": machine(), "load_avg_1m": os.getloadavg()[0]}))
    results: dict[str, dict[str, float]] = {}
    wanted = args.backends.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "sqlite" in wanted:
            results["sqlite"] = backend("sqlite", f"sqlite:///{tmp}/scale.db", args, Path(tmp))
        if "pg" in wanted:
            url, drop = pg_schema(args.pg_url)
            try:
                results["pg"] = backend("pg", url, args, Path(tmp))
            finally:
                drop()  # type: ignore[operator]
    out: dict[str, object] = {"steps": args.steps, "layers": args.layers, "heads": args.heads}
    for name, r in results.items():
        out[f"{name}_bytes_per_value"] = round(r["bytes_per_value"], 3)
        out[f"{name}_ingest_values_per_s"] = round(r["ingest_values_per_s"])
        out[f"{name}_gib_at_100k_steps"] = round(r["gib_100k"], 2)
    for q in ("heatmap", "head_heatmap", "series"):
        out[f"{q}_p95_ms"] = round(max(r[f"{q}_p95_ms"] for r in results.values()), 2)
    out["goals_met"] = {
        **{
            f"{k}_bytes": r["bytes_per_value"] <= GOALS["bytes_per_value"]
            for k, r in results.items()
        },
        **{f"{k}_ingest": r["ingest_values_per_s"] >= GOALS["ingest"] for k, r in results.items()},
        "heatmaps": max(out["heatmap_p95_ms"], out["head_heatmap_p95_ms"]) <= GOALS["heatmap_ms"],  # type: ignore[call-overload]
        "series": out["series_p95_ms"] <= GOALS["series_ms"],  # type: ignore[operator]
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
