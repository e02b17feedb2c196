"""The sink: never blocks, never loses, never duplicates; bad input is refused up front."""

from __future__ import annotations

import math
import multiprocessing
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from spikewatch.observatory import store
from spikewatch.observatory.store import db
from spikewatch.observatory.store.records import Record, RecordError
from spikewatch.observatory.store.sink import DbSink, NullSink

from . import workers
from .helpers import Proxy, assert_windows_consistent, count, stored_points

METRICS = ("train/loss", "layer/0/grad_norm", "layer/1/head/2/attn_max")


def _log_steps(sink: DbSink, steps: range, run: str = "r") -> None:
    for step in steps:
        sink.log_metrics(run, 0, step, {m: step + i / 10 for i, m in enumerate(METRICS)})
        if step % 50 == 0:
            sink.log_event(run, "note", step=step, message=f"at {step}")


def _assert_exactly_once(url: str, steps: int) -> None:
    engine = db.make_engine(url)
    points = stored_points(engine)
    assert len(points) == steps * len(METRICS)
    assert len({step for _, step, _ in points}) == steps
    assert count(engine, "SELECT COUNT(*) FROM events") == len(range(0, steps, 50))
    assert sum(1 for _, step, v in points if step == 123 and v == 123.1) == 1
    assert_windows_consistent(engine)
    engine.dispose()


def test_postgresql_unreachable_mid_run_loses_and_duplicates_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    real = make_url(pg_url)
    proxy = Proxy((real.host or "127.0.0.1", real.port or 5432))
    proxy.start()
    via_proxy = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    sink = DbSink(
        via_proxy,
        spool_dir=tmp_path / "spool",
        linger_s=0.01,
        retry_s=(0.05, 0.2),
        engine_kwargs={"connect_args": {"connect_timeout": 2}},
    )
    sink.start_run("r")
    _log_steps(sink, range(0, 300))
    assert sink.flush(30)
    proxy.stop()  # the database goes away mid-run
    _log_steps(sink, range(300, 700))  # logging goes on: enqueue only
    assert not sink.flush(1.0)  # cannot be in the database yet
    assert sink.stats["spooled"] > 0 and any((tmp_path / "spool").glob("spool-*.jsonl"))
    proxy.start()  # and comes back
    _log_steps(sink, range(700, 1000))
    assert sink.flush(60)
    sink.close()
    proxy.stop()
    assert not list((tmp_path / "spool").glob("spool-*"))  # replayed and deleted
    _assert_exactly_once(pg_url, 1000)


def test_sqlite_locked_mid_run_loses_and_duplicates_nothing(
    sqlite_url: str, tmp_path: Path
) -> None:
    sink = DbSink(
        sqlite_url,
        spool_dir=tmp_path / "spool",
        linger_s=0.01,
        retry_s=(0.05, 0.2),
        engine_kwargs={"sqlite_busy_ms": 100},
    )
    sink.start_run("r")
    _log_steps(sink, range(0, 300))
    assert sink.flush(30)
    blocker = sqlite3.connect(make_url(sqlite_url).database, isolation_level=None)
    blocker.execute("PRAGMA busy_timeout=0")
    blocker.execute("BEGIN EXCLUSIVE")  # nobody else may write: the database 'stops accepting'
    _log_steps(sink, range(300, 700))
    assert not sink.flush(1.0)
    assert sink.stats["spooled"] > 0
    blocker.execute("COMMIT")
    blocker.close()
    _log_steps(sink, range(700, 1000))
    assert sink.flush(60)
    sink.close()
    _assert_exactly_once(sqlite_url, 1000)


def test_full_queue_spills_to_the_spool_without_blocking(sqlite_url: str, tmp_path: Path) -> None:
    sink = DbSink(sqlite_url, spool_dir=tmp_path / "spool", queue_size=2, linger_s=0.01)
    sink.start_run("r")
    _log_steps(sink, range(0, 500))
    assert sink.stats["overflow"] > 0
    assert sink.flush(60)
    sink.close()
    _assert_exactly_once(sqlite_url, 500)


def test_a_new_sink_replays_the_spool_a_dead_process_left(sqlite_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    records = [Record("run", "r", {"status": "running", "config": {}, "tags": []})]
    records += [
        Record(
            "metrics",
            "r",
            {"branch": 0, "step": s, "values": {m: s + i / 10 for i, m in enumerate(METRICS)}},
        )
        for s in range(200)
    ]
    records += [
        Record(
            "event",
            "r",
            {
                "uid": f"u{s}",
                "kind": "note",
                "branch": 0,
                "step": s,
                "source": "t",
                "message": f"at {s}",
                "data": {},
            },
        )
        for s in range(0, 200, 50)
    ]
    lines = "".join(r.to_json() + "\n" for r in records)
    (spool / "spool-1-999999.jsonl").write_text(lines + '["metrics","r",{"bran')  # torn last line
    sink = DbSink(sqlite_url, spool_dir=spool, linger_s=0.01)
    assert sink.flush(30)
    sink.close()
    assert not list(spool.glob("spool-*"))
    _assert_exactly_once(sqlite_url, 200)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_four_processes_writing_concurrently_lose_nothing(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0  # after every child has imported and connected
    with ctx.Pool(4) as pool:
        args = [(url, str(tmp_path), w, start_at) for w in range(4)]
        results = pool.starmap(workers.write_steps, args)
    assert all(r["flushed"] for r in results), results
    engine = db.make_engine(url)
    per = workers.STEPS_PER_WORKER
    n_metrics = len(workers.METRICS)
    points = stored_points(engine)
    assert len(points) == 4 * per * n_metrics
    assert count(engine, "SELECT COUNT(*) FROM series") == n_metrics
    assert count(engine, "SELECT COUNT(*) FROM runs") == 1
    assert count(engine, "SELECT COUNT(*) FROM events") == 4 * len(range(0, per, 100))
    step = 3 * per + 17
    want = workers.value(3, step, 1)
    assert sum(1 for _, st, v in points if st == step and v == want) == 1
    assert_windows_consistent(engine)
    with store.session_factory(engine=engine)() as session:
        (s,) = store.series(session, run_id="shared", metric="train/loss", buckets=4)
        assert len(s.buckets) <= 4 and sum(b.n for b in s.buckets) == 4 * per
        assert s.buckets[-1].max_value == workers.value(3, 4 * per - 1, 0)


@pytest.mark.parametrize("sink_factory", [NullSink, "db"])
def test_bad_input_is_refused_with_a_clear_error_and_nothing_is_lost(
    sink_factory, sqlite_url: str, tmp_path
) -> None:
    sink = NullSink() if sink_factory is NullSink else DbSink(sqlite_url, spool_dir=tmp_path / "s")
    with pytest.raises(RecordError, match="start_run first"):
        sink.log_metrics("r", 0, 1, {"train/loss": 1.0})
    sink.start_run("r", config={"lr": 1e-3})
    sink.log_metrics("r", 0, 1, {"train/loss": 1.0})
    cases = [
        (lambda: sink.log_metrics("r", 0, 2, {"train/loss": "1.0"}), "must be a real number"),
        (lambda: sink.log_metrics("r", 0, -1, {"train/loss": 1.0}), r"step must be in \[0"),
        (lambda: sink.log_metrics("r", 0, 2.0, {"train/loss": 1.0}), "step must be an int"),
        (lambda: sink.log_metrics("r", 3, 2, {"train/loss": 1.0}), "branch 3 .* never started"),
        (lambda: sink.log_metrics("r", 0, 2, {"": 1.0}), "non-empty"),
        (lambda: sink.log_metrics("r", 0, 2, {"a*b": 1.0}), "may not contain"),
        (lambda: sink.log_metrics("r", 0, 2, [("train/loss", 1.0)]), "mapping"),
        (lambda: sink.log_metrics("r", 0, 2, {"layer/99999/x": 1.0}), "index above"),
        (lambda: sink.start_run("x" * 65), "run id"),
        (lambda: sink.start_run("r2", config={"lr": math.inf}), "without NaN"),
        (lambda: sink.start_run("r2", tags="abc"), "tags"),
        (lambda: sink.start_branch("r", 1, parent=4, fork_step=1), "parent branch 4"),
        (lambda: sink.log_event("r", "explosion", step=1), "event kind must be one of"),
        (lambda: sink.log_event("r", "spike", data={"x": object()}), "JSON"),
        (lambda: sink.log_checkpoint("r", step=1, path=""), "non-empty"),
        (
            lambda: sink.log_checkpoint("r", step=1, path="p", checksum_status="good"),
            "checksum_status",
        ),
        (lambda: sink.set_status("r", "exploded"), "status must be one of"),
    ]
    for call, message in cases:
        with pytest.raises(RecordError, match=message):
            call()
    sink.log_metrics("r", 0, 2, {"train/loss": 2.0, "layer/0/grad_norm": 0.5})
    assert sink.flush(30)
    sink.close()
    if sink_factory == "db":
        engine = db.make_engine(sqlite_url)
        assert len(stored_points(engine)) == 3  # the good calls, all of them
        assert count(engine, "SELECT COUNT(*) FROM runs") == 1


def test_a_closed_sink_refuses_new_records(sqlite_url: str, tmp_path: Path) -> None:
    sink = DbSink(sqlite_url, spool_dir=tmp_path / "s")
    sink.start_run("r")
    sink.close()
    with pytest.raises(RuntimeError, match="closed"):
        sink.log_metrics("r", 0, 1, {"x": 1.0})


def _records(steps: range) -> list[Record]:
    out = [Record("run", "r", {"status": "running", "config": {}, "tags": []})]
    out += [
        Record(
            "metrics",
            "r",
            {"branch": 0, "step": s, "values": {m: s + i / 10 for i, m in enumerate(METRICS)}},
        )
        for s in steps
    ]
    return out


def test_a_corrupt_spool_line_is_set_aside_and_the_rest_replayed(
    sqlite_url: str, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    lines = [r.to_json() + "\n" for r in _records(range(200))]
    bad = ['{"not": "a record"}\n', "\ufffd garbage \x00\n", '["metrics", 3, 4]\n']
    lines[50:50] = bad[:2]
    lines[120:120] = bad[2:]
    (spool / "spool-1-999999.jsonl").write_bytes("".join(lines).encode() + b"\xff\xfe\n")
    sink = DbSink(sqlite_url, spool_dir=spool, linger_s=0.01)
    assert sink.flush(30)
    sink.close()
    engine = db.make_engine(sqlite_url)
    assert len(stored_points(engine)) == 200 * len(METRICS)  # none after line 50
    engine.dispose()
    (kept,) = spool.glob("*.rejected-lines")  # nothing thrown away: the bad lines, verbatim
    assert kept.read_bytes() == "".join(bad).encode() + b"\xff\xfe\n"
    assert not list(spool.glob("spool-*.jsonl"))


class _Hung:
    """A database write that hangs until released (a lock held elsewhere, a dead network)."""

    def __init__(self, real) -> None:
        self.real, self.engine = real, real.engine
        self.release, self.entered = threading.Event(), threading.Event()

    def write(self, records):
        self.entered.set()
        self.release.wait(60)
        return self.real.write(records)


@pytest.mark.parametrize("how", ["persist", "close"])
def test_a_hung_database_leaves_every_record_in_the_spool(
    how: str, sqlite_url: str, tmp_path: Path
) -> None:
    """`persist(timeout)` (before a checkpoint is published) and `close(timeout)` return with
    every record logged so far in the spool file: a SIGKILL right after loses nothing. A copy
    of the spool, replayed by another sink, gives every row exactly once."""
    sink = DbSink(sqlite_url, spool_dir=tmp_path / "spool", linger_s=0.01)
    hung = sink._writer = _Hung(sink._writer)
    sink.start_run("r")
    _log_steps(sink, range(0, 5))
    assert hung.entered.wait(10)  # the writer holds the first records and waits
    _log_steps(sink, range(5, 300))
    if how == "persist":
        sink.persist(timeout=0.3)
    else:
        sink.close(timeout=0.3)
    dead = tmp_path / "as-left-by-sigkill"
    shutil.copytree(tmp_path / "spool", dead)  # the files the process would leave behind
    hung.release.set()
    sink.close(timeout=30)
    other = f"sqlite:///{tmp_path}/other.db"
    db.upgrade(other)
    DbSink(other, spool_dir=dead, linger_s=0.01).close(timeout=30)
    _assert_exactly_once(other, 300)
    _assert_exactly_once(sqlite_url, 300)  # and the live sink, once released, wrote them once


def test_an_event_sent_again_is_stored_once(sqlite_url: str, tmp_path: Path) -> None:
    """A resumed run recomputes the steps after its checkpoint and sends their events again:
    the same content has the same uid. A different field makes a different event."""
    for _ in range(2):
        sink = DbSink(sqlite_url, spool_dir=tmp_path / "spool")
        sink.start_run("r")
        uids = [
            sink.log_event("r", "spike", step=7, message="loss spike", data={"z": 9.5}),
            sink.log_event("r", "spike", step=7, message="loss spike", data={"z": 9.6}),
            sink.log_event("r", "spike", step=8, message="loss spike", data={"z": 9.5}),
        ]
        sink.close(timeout=30)
    assert len(set(uids)) == 3
    engine = db.make_engine(sqlite_url)
    assert count(engine, "SELECT COUNT(*) FROM events") == 3
    engine.dispose()


def test_many_steps_in_one_series_record_store_like_step_by_step(
    sqlite_url: str, tmp_path: Path
) -> None:
    """`log_series` (an import's one record for many steps) stores what `log_metrics` stores
    step by step: the first value of a step given twice, NaN kept, through a locked database
    and the spool file too; bad columns are refused before anything is queued."""
    import numpy as np

    by_step, by_series = tmp_path / "a.db", tmp_path / "b.db"
    urls = [f"sqlite:///{by_step}", f"sqlite:///{by_series}"]
    for url in urls:
        db.upgrade(url)
    steps = np.array([5, 1, 2, 2, 700, 3, 1500, 4], np.int64)  # out of order, 2 twice
    values = np.array([0.5, 0.1, 0.2, 9.9, math.nan, 0.3, 1.5, 0.4])
    one = DbSink(urls[0], spool_dir=tmp_path / "s1")
    one.start_run("r")
    for s, v in zip(steps.tolist(), values.tolist(), strict=True):
        one.log_metrics("r", 0, s, {"train/loss": v, "layer/1/grad_norm": 2 * v})
    one.close()
    two = DbSink(
        urls[1],
        spool_dir=tmp_path / "s2",
        linger_s=0.01,
        retry_s=(0.05, 0.2),
        engine_kwargs={"sqlite_busy_ms": 100},
    )
    two.start_run("r")
    assert two.flush(30)
    blocker = sqlite3.connect(by_series, isolation_level=None)
    blocker.execute("PRAGMA busy_timeout=0")
    blocker.execute("BEGIN EXCLUSIVE")
    with pytest.raises(RecordError, match="one length"):
        two.log_series("r", 0, {"train/loss": (steps, values[:-1])})
    with pytest.raises(RecordError, match="steps must be in"):
        two.log_series("r", 0, {"train/loss": ([-1], [1.0])})
    with pytest.raises(RecordError, match="never started"):
        two.log_series("r", 3, {"train/loss": (steps, values)})
    two.log_series(
        "r", 0, {"train/loss": (steps, values), "layer/1/grad_norm": (steps, 2 * values)}
    )
    assert not two.flush(1.0) and two.stats["spooled"] == 1  # the record waits in the spool
    blocker.execute("COMMIT")
    blocker.close()
    assert two.flush(60)
    two.close()
    got = [stored_points(db.make_engine(url)) for url in urls]
    assert len(got[0]) == 14 and repr(got[0]) == repr(got[1])  # repr: NaN equals NaN
    assert {v for _, step, v in got[1] if step == 2} == {0.2, 0.4}  # step 2's first values


def test_reach_says_how_far_a_run_got_on_a_branch(db_url: str, tmp_path: Path) -> None:
    """What a resume asks the store (trainer/core/recorder.py): the last step stored on a
    branch past a step, and the highest branch; (None, None) for a run the store lacks."""
    with DbSink(db_url, spool_dir=tmp_path / "spool", linger_s=0.01) as sink:
        sink.start_run("r", name="r", config={})
        for step in range(1, 14):
            sink.log_metrics("r", 0, step, {"train/loss": 2.0})
        sink.start_branch("r", 1, parent=0, fork_step=5)
        assert sink.reach("r", 0, 10) == (13, 1)  # steps 11-13 past 10, on branch 0
        assert sink.reach("r", 0, 13) == (None, 1)  # nothing past 13
        assert sink.reach("r", 1, 5) == (None, 1)  # branch 1 holds nothing yet
        assert sink.reach("other", 0, 0) == (None, None)
