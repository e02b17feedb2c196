"""A run's watchdog recorded a stall and no step has ended since: the API's run and the runs
page say "stalled"; once a `resumed` event follows, the run reads live again. Rows written
through the sink, read through the app (no training)."""

from __future__ import annotations

import dataclasses

from fastapi.testclient import TestClient

from spikewatch.observatory.store.db import upgrade
from spikewatch.observatory.store.sink import DbSink
from spikewatch.web.app import create_app
from spikewatch.web.settings import Settings


def _state(client: TestClient, run_id: str) -> tuple[bool, str]:
    (run,) = client.get("/api/runs").json()
    page = client.get("/").text
    row = page[page.index(f'data-run="{run_id}"') :]
    cell = row[row.index('class="state state-') :]
    return run["stalled"], cell[len('class="state state-') : cell.index('"', 20)]


def test_a_stall_without_a_resume_reads_stalled_and_a_resume_clears_it(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'sw.db'}"
    upgrade(url)
    sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
    sink.start_run("r1", name="r1", config={})
    sink.log_metrics("r1", 0, 10, {"train/loss": 2.0})
    sink.log_event("r1", "stall", step=10, message="stall", data={"idle_s": 130.0})
    assert sink.flush(timeout=30)
    with TestClient(create_app(Settings(db_url=url))) as client:
        assert _state(client, "r1") == (True, "stalled")
        assert "(stalled, step" in client.get("/runs/r1").text
        sink.log_event("r1", "resumed", step=11, message="resumed", data={"stalled_s": 140.0})
        assert sink.flush(timeout=30)
        assert _state(client, "r1") == (False, "live")
        sink.log_event("r1", "stall", step=40, message="stall again", data={"idle_s": 125.0})
        sink.set_status("r1", "failed")  # a run that ended is no longer stalled: it ended
        assert sink.flush(timeout=30)
        assert _state(client, "r1") == (False, "failed")
    sink.close(timeout=30)


def test_a_run_whose_heartbeat_stopped_reads_gone_and_one_that_ended_does_not(tmp_path) -> None:
    """The heartbeat says when the process last lived; two periods without one and no end
    record: the process is gone (killed). A stalled process still beats: stalled, not gone."""
    from datetime import UTC, datetime, timedelta

    from spikewatch.observatory import store

    url = f"sqlite:///{tmp_path / 'sw.db'}"
    upgrade(url)
    with DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01) as sink:
        for run in ("beating", "ended", "old"):
            sink.start_run(run, name=run, config={})
            sink.log_metrics(run, 0, 10, {"train/loss": 2.0})
        for run in ("beating", "ended"):
            sink.heartbeat(run, 5.0)
        sink.set_status("ended", "completed")
        assert sink.flush(timeout=30)
    with store.session_factory(url)() as s:
        runs = {r.run_id: r for r in store.list_runs(s)}
    beat = runs["beating"].heartbeat_at
    assert beat is not None and runs["beating"].heartbeat_s == 5.0
    at = {"fresh": beat + timedelta(seconds=9), "late": beat + timedelta(seconds=11)}
    assert store.run_state(runs["beating"], at["fresh"]) == "live"
    assert store.run_state(runs["beating"], at["late"]) == "gone"
    assert store.run_state(runs["ended"], at["late"]) == "completed"
    # no heartbeat (a follower's run, an older writer's): never gone, silent when quiet
    assert store.run_state(runs["old"], datetime.now(UTC) + timedelta(hours=1)) == "silent"
    stalled = dataclasses.replace(runs["beating"], stalled=True)
    assert store.run_state(stalled, at["fresh"]) == "stalled"
    with TestClient(create_app(Settings(db_url=url))) as client:
        listed = {r["run_id"]: r["state"] for r in client.get("/api/runs").json()}
    assert listed == {"beating": "live", "ended": "completed", "old": "live"}
