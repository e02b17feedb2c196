"""Round-trips through the sink and the queries, on SQLite and on PostgreSQL."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from spikewatch.observatory import store
from spikewatch.observatory.store import db
from spikewatch.observatory.store.ingest import Writer
from spikewatch.observatory.store.records import Record
from spikewatch.observatory.store.sink import DbSink

from .helpers import assert_windows_consistent, count, stored_points


def _sink(url: str, tmp_path: Path) -> DbSink:
    return DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)


def _writer(url: str, run: str = "r") -> Writer:
    w = Writer(db.make_engine(url, writer=True))
    w.write([Record("run", run, {"status": "running", "config": {}, "tags": []})])
    return w


def test_round_trip_run_metrics_events_checkpoints(db_url: str, tmp_path: Path) -> None:
    config = {"model": {"n_layer": 2, "qk_norm": True}, "optim": {"lr": 3e-3}}
    with _sink(db_url, tmp_path) as sink:
        sink.start_run(
            "run-1",
            name="baseline",
            config=config,
            tags=["ablation", "cpu"],
            sweep_group="sweep-a",
            hypothesis="QK-norm removes the step-200 spike",
            run_dir=tmp_path,
        )
        for step in range(1, 101):
            sink.log_metrics(
                "run-1",
                0,
                step,
                {
                    "train/loss": 5.0 / step,
                    "optim/lr": 1e-3,
                    "layer/0/grad_norm": 0.1 * step,
                    "layer/1/grad_norm": 0.2 * step,
                    "layer/1/head/0/attn_max": float(step),
                    "layer/1/head/3/attn_max": -float(step),
                },
            )
        uid = sink.log_event("run-1", "spike", step=50, message="z=7.1", data={"score": 7.1})
        sink.log_event("run-1", "annotation", message="looks fine", source="user")
        sink.log_checkpoint("run-1", step=50, path=tmp_path / "step00000050", pinned=True)
        sink.log_checkpoint("run-1", step=50, path=tmp_path / "step00000050", checksum_status="ok")
        sink.set_status("run-1", "completed")
        assert sink.flush(30)

    session = store.session_factory(db_url)()
    (run,) = store.list_runs(session)
    assert (run.run_id, run.name, run.status, run.tags) == (
        "run-1",
        "baseline",
        "completed",
        ["ablation", "cpu"],
    )
    assert (run.sweep_group, run.hypothesis, run.config) == (
        "sweep-a",
        "QK-norm removes the step-200 spike",
        config,
    )
    assert (run.last_step, run.last_loss, run.spikes, run.rollbacks, run.branches) == (
        100,
        0.05,
        1,
        0,
        1,
    )
    assert run.ended_at is not None and run.created_at.tzinfo is not None  # UTC on both
    assert store.get_run(session, run_id="run-1") == run
    assert store.list_runs(session, status="running") == []
    assert store.metric_names(session, run_id="run-1") == [
        "layer/*/grad_norm",
        "layer/*/head/*/attn_max",
        "optim/lr",
        "train/loss",
    ]
    (loss,) = store.series(session, run_id="run-1", metric="train/loss", buckets=1000)
    assert [(b.min_step, b.min_value) for b in loss.buckets] == [
        (s, 5.0 / s) for s in range(1, 101)
    ]
    assert all(b.max_value == b.min_value and b.n == 1 for b in loss.buckets)
    (layer1,) = store.series(session, run_id="run-1", metric="layer/1/grad_norm", buckets=1)
    assert (layer1.buckets[0].max_value, layer1.buckets[0].max_step) == (pytest.approx(20.0), 100)
    events = store.events(session, run_id="run-1")
    assert [(e.kind, e.step, e.source) for e in events] == [
        ("spike", 50, "trainer"),
        ("annotation", None, "user"),
    ]
    assert (
        events[0].uid == uid and events[0].data == {"score": 7.1} and events[0].message == "z=7.1"
    )
    assert store.events(session, run_id="run-1", kinds=["rollback"]) == []
    (ckpt,) = store.checkpoints(session, run_id="run-1")
    assert (ckpt.step, ckpt.pinned, ckpt.checksum_status) == (50, False, "ok")  # upserted by path
    session.close()


def test_layer_and_head_matrices(db_url: str, tmp_path: Path) -> None:
    with _sink(db_url, tmp_path) as sink:
        sink.start_run("m")
        for step in range(64):
            values = {f"layer/{layer}/update_ratio": layer * 1000.0 + step for layer in range(4)}
            values |= {f"layer/2/head/{h}/attn_max": h * 10.0 + (step == 40) * 99 for h in range(3)}
            sink.log_metrics("m", 0, step, values)
        assert sink.flush(30)
    with store.session_factory(db_url)() as session:
        m = store.layer_matrix(session, run_id="m", metric="layer/*/update_ratio", buckets=4)
        assert m.rows == [0, 1, 2, 3] and m.starts == [0, 16, 32, 48] and m.bucket_width == 16
        assert m.max_value[3] == [3015.0, 3031.0, 3047.0, 3063.0]
        assert m.min_step[1] == [0, 16, 32, 48] and m.n[0] == [16, 16, 16, 16]
        h = store.head_matrix(
            session, run_id="m", metric="layer/*/head/*/attn_max", layer=2, buckets=4
        )
        assert h.rows == [0, 1, 2]
        assert [row[2] for row in h.max_value] == [99.0, 109.0, 119.0]
        assert [row[2] for row in h.max_step] == [40, 40, 40]
        for full in (m, h):  # maxima only: the same maxima, counts and steps; no minima
            layer = 2 if full is h else None
            fn = store.head_matrix if full is h else store.layer_matrix
            kw = {"layer": layer} if layer is not None else {}
            top = fn(session, run_id="m", metric=full.metric, buckets=4, extremes="max", **kw)
            assert (top.max_value, top.max_step, top.n) == (full.max_value, full.max_step, full.n)
            assert {v for row in top.min_value + top.min_step for v in row} == {None}
        with pytest.raises(store.NotFoundError, match="layer/\\*/"):  # no such matrix
            store.layer_matrix(session, run_id="m", metric="update_ratio")
        with pytest.raises(store.NotFoundError, match="may not contain"):  # no such metric
            store.series(session, run_id="m", metric="layer/*/attn_max")
        with pytest.raises(store.NotFoundError):
            store.head_matrix(session, run_id="m", metric="layer/*/head/*/attn_max", layer=7)


def _expected_buckets(steps: np.ndarray, values: np.ndarray, width: int) -> dict[int, tuple]:
    """Per bucket (n, min, its step, max, its step) by numpy; `steps` sorted, values distinct."""
    keys = steps // width
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    out = {}
    for a, b in zip(starts, [*starts[1:], len(steps)], strict=True):
        v = values[a:b]
        i, j = a + int(np.argmin(v)), a + int(np.argmax(v))
        out[int(keys[a])] = (
            b - a,
            float(values[i]),
            int(steps[i]),
            float(values[j]),
            int(steps[j]),
        )
    return out


def test_one_step_spike_among_a_million_points_survives(db_url: str) -> None:
    rng = np.random.default_rng(0)
    steps = np.arange(1_000_000)
    values = 2.0 + 0.01 * rng.standard_normal(len(steps))
    values[731_337] = 97.25  # the spike
    values[123_457] = -3.5  # and a dip
    writer = _writer(db_url)
    writer.write_series("r", 0, "train/loss", steps, values)
    with store.session_factory(db_url)() as session:
        (full,) = store.series(session, run_id="r", metric="train/loss", buckets=2000)
        assert len(full.buckets) <= 2000 and sum(b.n for b in full.buckets) == 1_000_000
        top = max(full.buckets, key=lambda b: b.max_value)
        low = min(full.buckets, key=lambda b: b.min_value)
        assert (top.max_value, top.max_step) == (97.25, 731_337)
        assert (low.min_value, low.min_step) == (-3.5, 123_457)
        # every bucket is exact, also for a window whose edges cut through blocks
        for start, end, n in [(None, None, 2000), (700_001, 760_003, 500), (731_000, 731_700, 70)]:
            (part,) = store.series(
                session, run_id="r", metric="train/loss", buckets=n, start=start, end=end
            )
            lo, hi = start or 0, end if end is not None else 999_999
            sel = slice(lo, hi + 1)
            want = _expected_buckets(steps[sel], values[sel], part.bucket_width)
            got = {
                b.start // part.bucket_width: (
                    b.n,
                    b.min_value,
                    b.min_step,
                    b.max_value,
                    b.max_step,
                )
                for b in part.buckets
            }
            assert got == want
            assert any(b.max_value == 97.25 and b.max_step == 731_337 for b in part.buckets)


def test_nan_and_inf_are_stored_and_reported_as_nonfinite(db_url: str, tmp_path: Path) -> None:
    special = {10: math.nan, 11: math.inf, 12: -math.inf, 40: math.nan, 41: math.nan}
    with _sink(db_url, tmp_path) as sink:
        sink.start_run("nf")
        for step in range(48):
            sink.log_metrics("nf", 0, step, {"train/loss": special.get(step, 1.0 + step / 100)})
        assert sink.flush(30)
    with store.session_factory(db_url)() as session:
        (raw,) = store.series(session, run_id="nf", metric="train/loss", buckets=48)
        by_step = {b.start: b for b in raw.buckets}
        assert store.get_run(session, run_id="nf").last_loss == 1.47
        assert by_step[10].n_nan == 1 and by_step[10].min_value is None and by_step[10].nonfinite
        assert by_step[11].max_value == math.inf and by_step[12].min_value == -math.inf
        assert not by_step[13].nonfinite
        (coarse,) = store.series(session, run_id="nf", metric="train/loss", buckets=3)
        first, _, last = coarse.buckets
        assert (first.n, first.n_nan, first.nan_step) == (16, 1, 10)
        assert (first.max_value, first.max_step, first.min_value, first.min_step) == (
            math.inf,
            11,
            -math.inf,
            12,
        )
        assert (last.n_nan, last.nan_step, last.nonfinite) == (2, 40, True)
    assert_windows_consistent(db.make_engine(db_url))


def test_branches_after_a_rollback_keep_both_histories(db_url: str, tmp_path: Path) -> None:
    with _sink(db_url, tmp_path) as sink:
        sink.start_run("rb")
        for step in range(1, 301):
            sink.log_metrics("rb", 0, step, {"train/loss": 9.0 if step == 250 else 1.0})
        sink.log_event("rb", "spike", step=250, branch=0)
        sink.log_event("rb", "rollback", step=250, branch=0, data={"to_step": 200})
        sink.start_branch("rb", 1, parent=0, fork_step=200, reason="spike at 250")
        for step in range(201, 401):
            sink.log_metrics("rb", 1, step, {"train/loss": 0.5})
        assert sink.flush(30)
    with store.session_factory(db_url)() as session:
        summary = store.get_run(session, run_id="rb")
        assert (summary.branches, summary.last_step, summary.last_loss) == (2, 400, 0.5)
        assert (summary.spikes, summary.rollbacks) == (1, 1)
        assert [
            (b.number, b.parent, b.fork_step) for b in store.branches(session, run_id="rb")
        ] == [
            (0, None, None),
            (1, 0, 200),
        ]
        old, new = store.series(
            session, run_id="rb", metric="train/loss", branch="all", buckets=10_000
        )
        assert [b.start for b in old.buckets] == list(range(1, 301))  # the abandoned steps stay
        assert max(b.max_value for b in old.buckets) == 9.0
        assert [b.start for b in new.buckets] == list(range(201, 401))
        (current,) = store.series(session, run_id="rb", metric="train/loss", buckets=10_000)
        assert current.branch == 1 and current.segments == [(0, 1, 200), (1, 201, 400)]
        assert [b.max_value for b in current.buckets] == [1.0] * 200 + [0.5] * 200
        (coarse,) = store.series(session, run_id="rb", metric="train/loss", branch=1, buckets=2)
        assert max(b.max_value for b in coarse.buckets) == 1.0  # the spike is not in branch 1
        (before,) = store.series(session, run_id="rb", metric="train/loss", branch=0, buckets=2)
        assert max(b.max_value for b in before.buckets) == 9.0
        with pytest.raises(store.NotFoundError, match="no branch 5"):
            store.series(session, run_id="rb", metric="train/loss", branch=5)


def test_replaying_batches_never_duplicates(db_url: str) -> None:
    writer = _writer(db_url)
    records = [
        Record("metrics", "r", {"branch": 0, "step": s, "values": {"a": float(s), "b": -float(s)}})
        for s in range(100)
    ]
    event = Record(
        "event",
        "r",
        {
            "uid": "e1",
            "kind": "halt",
            "branch": 0,
            "step": 5,
            "source": "t",
            "message": "",
            "data": {},
        },
    )
    assert writer.write([*records[:60], event]) == 120
    writer.write([*records[40:], event])  # overlaps: 40..59 are replays
    writer.write(records)  # everything again
    writer.write_series("r", 0, "a", np.arange(50, 150), np.zeros(100))  # 50..99 exist
    engine = writer.engine
    points = stored_points(engine)
    assert len(points) == 250
    assert count(engine, "SELECT COUNT(*) FROM events") == 1
    assert sum(1 for _, step, v in points if step == 70 and v == 70) == 1  # first kept
    assert_windows_consistent(engine)


def test_delete_run_removes_everything(db_url: str) -> None:
    writer = _writer(db_url, "gone")
    writer.write_series("gone", 0, "x", np.arange(5000), np.ones(5000))
    with store.session_factory(db_url)() as session, session.begin():
        store.delete_run(session, run_id="gone")
    for table in ("point_chunks", "point_tails", "series", "runs", "branches"):
        assert count(writer.engine, f"SELECT COUNT(*) FROM {table}") == 0


def test_unknown_names_are_clear_errors(sqlite_url: str) -> None:
    _writer(sqlite_url)
    with store.session_factory(sqlite_url)() as session:
        with pytest.raises(store.NotFoundError, match="no run 'nope'"):
            store.series(session, run_id="nope", metric="train/loss")
        with pytest.raises(store.NotFoundError, match="no metric"):
            store.series(session, run_id="r", metric="train/loss")
        with pytest.raises(ValueError, match="buckets"):
            store.series(session, run_id="r", metric="x", buckets=0)


def test_the_run_list_costs_the_same_statements_for_1_or_6_runs(db_url: str, tmp_path) -> None:
    """Summaries (branches, last loss of the newest branch, spikes, rollbacks) are read for all
    runs at once: the run list's statement count does not grow with the runs."""
    from sqlalchemy import event

    with _sink(db_url, tmp_path) as sink:
        for i in range(6):
            run = f"run-{i}"
            sink.start_run(run, name=run, config={}, tags=[], run_dir=tmp_path)
            for step in range(1, 6):
                sink.log_metrics(run, 0, step, {"train/loss": float(i + step)})
            if i % 2:
                sink.start_branch(run, 1, parent=0, fork_step=3, reason="rollback")
                sink.log_metrics(run, 1, 4, {"train/loss": 0.5})
                sink.log_event(run, "rollback", step=5, branch=0, message="back to 3")
        assert sink.flush(30)
    engine = db.make_engine(db_url)
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))

    def counted(limit: int) -> tuple[int, list]:
        statements.clear()
        runs = store.list_runs(session, limit=limit)
        return len(statements), runs

    with store.session_factory(db_url, engine=engine)() as session:  # closed: no open transaction
        counted(1)  # the connection's own set-up statements, once
        one, _ = counted(1)
        six, runs = counted(6)
    engine.dispose()
    assert one == six <= 4, statements  # runs, events, branches, last losses
    by_id = {r.run_id: r for r in runs}
    assert (by_id["run-1"].branches, by_id["run-1"].last_step, by_id["run-1"].last_loss) == (
        2,
        4,
        0.5,
    )
    assert (by_id["run-2"].branches, by_id["run-2"].last_step, by_id["run-2"].rollbacks) == (
        1,
        5,
        0,
    )
    assert by_id["run-3"].rollbacks == 1


def test_reads_across_runs_equal_the_single_run_reads(db_url: str, tmp_path) -> None:
    """`across_runs` (the compare page's reads, a fixed number of statements) gives what the
    single-run reads give: the newest branch's history, its layer maxima, its first and last
    values, and the peak over every branch."""
    from spikewatch.observatory.store import across_runs as across

    with _sink(db_url, tmp_path) as sink:
        for i in range(3):
            run = f"run-{i}"
            sink.start_run(run, name=run, config={}, tags=[], run_dir=tmp_path)
            for step in range(1, 41):
                v = float(i + step % 7) if step != 17 else math.nan
                sink.log_metrics(run, 0, step, {"train/loss": v, "layer/1/attn_max": 3.0 * v})
                sink.log_metrics(run, 0, step, {"layer/0/attn_max": 2.0 * step})
            if i:
                sink.start_branch(run, 1, parent=0, fork_step=30 - i, reason="rollback")
                for step in range(31 - i, 41):
                    sink.log_metrics(
                        run, 1, step, {"train/loss": 0.5 * step, "layer/0/attn_max": 1.0}
                    )
        assert sink.flush(30)
    with store.session_factory(db_url)() as s:
        rows = across.runs_by_key(s, ["run-0", "run-1", "run-2", "nope"])
        assert sorted(rows) == ["run-0", "run-1", "run-2"]
        many = across.histories(s, rows, "train/loss", buckets=40)
        mats = across.layer_matrices(s, rows, "layer/*/attn_max", buckets=40)
        pks = [rows[k].id for k in sorted(rows)]
        tree_of = across.trees(s, pks)
        first = across.end_values(s, pks, tree_of, "train/loss", last=False)
        last = across.end_values(s, pks, tree_of, "train/loss", last=True)
        peak = across.peaks(s, pks, "layer/*/attn_max")
        for run_id, row in rows.items():
            (one,) = store.series(s, run_id=run_id, metric="train/loss", buckets=40)
            assert many[run_id] == [one]
            m = store.layer_matrix(s, run_id=run_id, metric="layer/*/attn_max", buckets=40)
            got = mats[run_id]
            assert (got.rows, got.max_value, got.max_step) == (m.rows, m.max_value, m.max_step)
            (full,) = store.series(s, run_id=run_id, metric="train/loss", buckets=10_000)
            assert first[row.id] == full.buckets[0].max_value
            assert last[row.id] == full.buckets[-1].max_value
            every = [
                b.max_value
                for layer in (0, 1)
                for sd in store.series(
                    s, run_id=run_id, metric=f"layer/{layer}/attn_max", branch="all"
                )
                for b in sd.buckets
                if b.max_value is not None
            ]
            assert peak[row.id] == max(every)
