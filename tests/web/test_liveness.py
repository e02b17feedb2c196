"""A run's watchdog recorded a stall and no step has ended since: the API's run and the runs
page say "stalled"; once a `resumed` event follows, the run reads live again. Rows written
through the sink, read through the app (no training)."""

from __future__ import annotations

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
