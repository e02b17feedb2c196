"""The store's faults never stall training (issue 46): `persist` before a checkpoint does not wait
for a store that is unreachable or behind, spooled records arrive once and in order, and a spool
that cannot be written loses nothing it can keep and counts what it cannot."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from spikewatch.observatory.store import db, spool
from spikewatch.observatory.store.records import Record
from spikewatch.observatory.store.sink import PERSIST_MAX_S, DbSink
from spikewatch.observatory.store.spool import Spool
from spikewatch.trainer.cli import main as cli_main

from .helpers import Proxy, count, stored_points

METRICS = ("train/loss", "layer/0/grad_norm")


def _log(sink: DbSink, steps: range) -> None:
    for step in steps:
        sink.log_metrics("r", 0, step, {m: step + i / 10 for i, m in enumerate(METRICS)})


def _until(cond, what: str, limit: float = 30.0) -> None:
    """Wait for a condition the sink reaches on its own thread (not a timing assertion)."""
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def _replayed_elsewhere(spool_dir: Path, tmp_path: Path, name: str) -> str:
    """What a SIGKILL right now would leave: a copy of the spool, replayed into a new store."""
    dead = tmp_path / f"{name}-as-left"
    shutil.copytree(spool_dir, dead)
    other = f"sqlite:///{tmp_path}/{name}.db"
    db.upgrade(other)
    DbSink(other, spool_dir=dead, linger_s=0.01).close(timeout=30)
    return other


def _steps_stored(url: str) -> list[int]:
    engine = db.make_engine(url)
    steps = sorted(step for _, step, _ in stored_points(engine))
    engine.dispose()
    return steps


class _Spy:
    def __init__(self, real) -> None:
        self.real, self.calls = real, []

    def __call__(self, timeout=None):
        self.calls.append(timeout)
        return self.real(timeout)


def test_an_unreachable_store_is_not_waited_for(pg_url: str, tmp_path: Path) -> None:
    """The database went away and the sink knows it: `persist` spools at once, without a flush
    (today it waited 10 s for a database that was refusing connections), and everything logged
    so far is in the spool file."""
    real = make_url(pg_url)
    proxy = Proxy((real.host or "127.0.0.1", real.port or 5432))
    proxy.start()
    url = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01, retry_s=(0.05, 0.2))
    sink.start_run("r")
    _log(sink, range(0, 100))
    assert sink.flush(30)
    proxy.stop()
    _log(sink, range(100, 150))
    _until(lambda: sink.stats["spooled"] > 0, "the sink found the database unreachable")
    _log(sink, range(150, 200))  # queued behind a database known to be away
    sink.flush = spy = _Spy(sink.flush)  # type: ignore[method-assign]
    sink.persist()
    assert spy.calls == []  # not waited for
    assert _steps_stored(_replayed_elsewhere(tmp_path / "spool", tmp_path, "kill")) == sorted(
        list(range(100, 200)) * len(METRICS)
    )
    proxy.start()
    assert spy.real(60)
    sink.close()
    proxy.stop()
    assert _steps_stored(pg_url) == sorted(list(range(200)) * len(METRICS))


class _Slow:
    """A database whose writes are quick until `hang` is set, then hang until released."""

    def __init__(self, real) -> None:
        self.real, self.engine = real, real.engine
        self.hang, self.release, self.entered = (threading.Event() for _ in range(3))

    def write(self, records):
        if self.hang.is_set():
            self.entered.set()
            self.release.wait(60)
        return self.real.write(records)


def test_a_store_keeping_pace_is_waited_for_its_own_pace_only(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A store that has kept pace is waited for twice its slowest recent write (capped at
    PERSIST_MAX_S), not a fixed 10 s; past that, everything goes to the spool, and a kill
    right after loses nothing."""
    sink = DbSink(sqlite_url, spool_dir=tmp_path / "spool", linger_s=0.01)
    slow = sink._writer = _Slow(sink._writer)
    sink.start_run("r")
    for block in range(5):  # observed: a handful of quick writes
        _log(sink, range(block * 20, block * 20 + 20))
        assert sink.flush(30)
    slow.hang.set()
    _log(sink, range(100, 101))
    assert slow.entered.wait(10)  # the writer is stuck in a write now
    _log(sink, range(101, 160))
    sink.flush = spy = _Spy(sink.flush)  # type: ignore[method-assign]
    sink.persist()
    assert len(spy.calls) <= 1
    if spy.calls:  # waited the store's pace, a few milliseconds, never the old 10 s
        assert spy.calls[0] == sink.wait_bound() <= PERSIST_MAX_S
    assert _steps_stored(_replayed_elsewhere(tmp_path / "spool", tmp_path, "kill")) == sorted(
        list(range(100, 160)) * len(METRICS)
    )
    slow.release.set()
    assert spy.real(60)
    sink.close()
    assert _steps_stored(sqlite_url) == sorted(list(range(160)) * len(METRICS))


def test_records_reach_the_store_in_the_order_they_were_logged(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A checkpoint written, then deleted, while the database hangs and the queue is full: the
    spool must keep the order, or the replay stores the deletion first and the write over it
    (today a full queue spooled the newest record alone, ahead of the older ones queued)."""
    sink = DbSink(sqlite_url, spool_dir=tmp_path / "spool", linger_s=0.01, queue_size=1)
    slow = sink._writer = _Slow(sink._writer)
    slow.hang.set()
    sink.start_run("r")
    assert slow.entered.wait(10)  # the writer holds the run and hangs
    sink.log_checkpoint("r", step=10, path="ck/10", checksum_status="ok")  # queued
    sink.log_checkpoint("r", step=10, path="ck/10", checksum_status="deleted")  # queue full
    sink.log_event("r", "note", step=11, message="after the deletion")
    assert sink.stats["overflow"] >= 1
    slow.release.set()
    assert sink.flush(60)
    sink.close()
    engine = db.make_engine(sqlite_url)
    with engine.connect() as conn:
        status = conn.execute(text("SELECT checksum_status FROM checkpoints")).scalar_one()
    assert status == "deleted"
    assert count(engine, "SELECT COUNT(*) FROM events") == 1
    engine.dispose()


def test_an_unwritable_spool_keeps_records_in_memory_and_counts_what_it_cannot(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The database away and the spool directory unusable (here a file stands where it should
    be, so even root cannot create it): the run goes on, the records wait in memory and reach
    the database when it is back; past `hold_values`, the oldest are dropped, counted in
    `stats['lost']` and said in an error line: never silently."""
    real = make_url(pg_url)
    proxy = Proxy((real.host or "127.0.0.1", real.port or 5432))
    proxy.start()
    url = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    blocked = tmp_path / "spool"
    blocked.write_text("not a directory")
    sink = DbSink(url, spool_dir=blocked, linger_s=0.01, retry_s=(0.05, 0.2))
    sink.start_run("r")
    _log(sink, range(0, 50))
    assert sink.flush(30)
    proxy.stop()
    with caplog.at_level(logging.WARNING):
        _log(sink, range(50, 150))
        _until(lambda: any("write failed" in r.getMessage() for r in caplog.records), "a failure")
        sink.persist()  # cannot spool: said, and the run goes on
    assert any("cannot write" in r.getMessage() for r in caplog.records)
    proxy.start()
    assert sink.flush(60)  # held in memory, written when the database is back
    assert sink.stats["lost"] == 0
    sink._backlog.hold_values = 40  # now only 20 steps of 2 values fit in memory
    proxy.stop()
    with caplog.at_level(logging.ERROR):
        _log(sink, range(150, 250))
        _until(lambda: sink._backlog.lost[0] > 0, "records dropped past hold_values")
        sink.close(timeout=5)  # the database still away: what is held is lost too, and said
    proxy.stop()
    lost = sink.stats["lost"]
    assert lost > 0 and any("LOST" in r.getMessage() for r in caplog.records)
    stored = _steps_stored(pg_url)
    assert stored[: 150 * len(METRICS)] == sorted(list(range(150)) * len(METRICS))
    assert len(stored) == 250 * len(METRICS) - sink.stats["lost_values"]  # as counted
    assert sink.stats["lost_values"] == lost * len(METRICS)


def test_a_spool_write_that_fails_part_way_is_cut_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk mid-append: the segment is cut back to its last whole record, so the next
    append does not follow a torn line (which would set both aside on replay)."""
    sp = Spool(tmp_path / "spool")
    recs = [Record("status", f"r{i}", {"status": "running"}) for i in range(6)]
    sp.append(recs[:2])
    real_write = os.write

    def half_then_full(fd: int, data) -> int:
        monkeypatch.setattr(spool.os, "write", real_write)
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space"):
        sp.append(recs[2:4])
    sp.append(recs[4:])
    (segment,) = sp.rotate()
    read = [r for chunk in Spool.read(segment, 1000) for r in chunk]
    assert [r.run for r in read] == ["r0", "r1", "r4", "r5"]
    assert not list((tmp_path / "spool").glob("*.rejected*"))


def test_db_upgrade_replays_the_spool_a_finished_run_left(sqlite_url: str, tmp_path: Path) -> None:
    """A run whose database was away until after its end: `spikewatch db upgrade` replays the
    spool in its run directory (the store knows the run directory) and deletes it."""
    run_dir = tmp_path / "runs" / "r"
    sink = DbSink(sqlite_url, spool_dir=run_dir / "spool", linger_s=0.01)
    sink.start_run("r", run_dir=run_dir)
    _log(sink, range(0, 10))
    assert sink.flush(30)
    sink.close()
    left = Spool(run_dir / "spool")  # what the sink spooled while the database was away
    values = {"train/loss": 1.0}
    left.append(
        [Record("metrics", "r", {"branch": 0, "step": s, "values": values}) for s in range(10, 30)]
    )
    left.rotate()
    assert cli_main(["db", "upgrade", "--db", sqlite_url]) == 0
    assert not list((run_dir / "spool").glob("spool-*"))
    assert _steps_stored(sqlite_url).count(29) == 1


class _Sleepy:
    """A store whose every write takes `seconds` (a busy disk's fsync)."""

    def __init__(self, real, seconds: float) -> None:
        self.real, self.engine, self.seconds = real, real.engine, seconds

    def write(self, records):
        time.sleep(self.seconds)
        return self.real.write(records)


def test_a_store_a_little_slower_than_a_checkpoint_waits_is_not_warned_of(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    """Writes of 0.15 s, slower than a checkpoint waits (the records go by the spool, a moment
    later): routine, no warning. A store with no write through for BEHIND_WARN_S: one warning,
    naming the spool."""
    from spikewatch.observatory.store import sink as sink_mod

    sink = DbSink(sqlite_url, spool_dir=tmp_path / "spool", linger_s=0.01)
    sink._writer = _Sleepy(sink._writer, 0.15)
    sink.start_run("r")
    with caplog.at_level(logging.WARNING):
        for block in range(6):  # a checkpoint every 20 steps
            _log(sink, range(block * 20, block * 20 + 20))
            sink.persist()
            time.sleep(0.2)
        assert sink.flush(60)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("spikewatch")] == []
    assert _steps_stored(sqlite_url) == sorted(list(range(120)) * len(METRICS))
    monkeypatch.setattr(sink_mod, "BEHIND_WARN_S", 0.5)
    slow = sink._writer = _Slow(sink._writer)
    slow.hang.set()
    with caplog.at_level(logging.WARNING):
        _log(sink, range(120, 121))
        assert slow.entered.wait(10)  # stuck in a write from here on
        for block in range(4):
            _log(sink, range(121 + block, 122 + block))
            sink.persist()
            time.sleep(0.3)
    said = [r.getMessage() for r in caplog.records if "spool file" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "spool") in said[0], said
    slow.release.set()
    sink.close(60)
