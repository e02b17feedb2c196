"""The run page's own lines, rows written through the sink and read through the app (no
training): the measured snapshot interval, the interventions table's ranks."""

from __future__ import annotations

from fastapi.testclient import TestClient

from spikewatch.observatory.store.db import upgrade
from spikewatch.observatory.store.sink import DbSink
from spikewatch.web.app import create_app
from spikewatch.web.settings import Settings


def _sink(tmp_path) -> tuple[str, DbSink]:  # noqa: ANN001
    url = f"sqlite:///{tmp_path / 'sw.db'}"
    upgrade(url)
    sink = DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01)
    sink.start_run("r1", name="r1", config={})
    return url, sink


def test_the_run_page_says_the_measured_snapshot_interval(tmp_path) -> None:
    """memory_interval 'auto': each snapshot records the interval it was taken at; the run
    page's checkpoints section says the newest."""
    url, sink = _sink(tmp_path)
    for step, every in ((5, 5), (14, 9), (22, 8)):
        sink.log_metrics("r1", 0, step, {"train/loss": 2.0, "checkpoint/memory_interval": every})
    assert sink.flush(timeout=30)
    with TestClient(create_app(Settings(db_url=url))) as client:
        page = client.get("/runs/r1").text
        assert 'id="ckpt-memory-interval">Host-memory snapshots every 8 steps' in page
    sink.close(timeout=30)


def test_the_interventions_table_shows_ranks_as_a_list_never_as_brackets(tmp_path) -> None:
    """Issue 58 item 4: the ranks column showed a raw `[]`."""
    url, sink = _sink(tmp_path)
    sink.log_metrics("r1", 0, 10, {"train/loss": 2.0})
    for step, ranks in ((20, []), (40, [0, 1])):
        data = {"to_step": step - 10, "ranks": ranks}
        sink.log_event("r1", "rollback", step=step, message="x", data=data)
    assert sink.flush(timeout=30)
    with TestClient(create_app(Settings(db_url=url))) as client:
        page = client.get("/runs/r1").text
    table = page[page.index("<th>ranks</th>") :]
    table = table[: table.index("</table>")]
    assert "[]" not in table and "[0, 1]" not in table
    assert "<td>0, 1</td>" in table and "<td>&ndash;</td>" in table
    sink.close(timeout=30)


def test_chosen_runs_of_one_cell_are_all_compared_with_their_spikes(tmp_path) -> None:
    """Issue 58 item 4: a fault run, its clean twin and its no-rollback twin (one config: one
    cell of a sweep report, which keeps the newest) compared: only one was drawn. Every chosen
    run is drawn now, each spike marked on its own line."""
    import json

    url, sink = _sink(tmp_path)
    for run in ("r2", "r3"):
        sink.start_run(run, name=run, config={})
    for run, bump in (("r1", 0.0), ("r2", 5.0), ("r3", 0.0)):
        for step in range(1, 6):
            loss = 2.0 + (bump if step == 3 else 0.0)
            sink.log_metrics(run, 0, step, {"train/loss": loss})
    sink.log_event("r2", "spike", step=3, message="spike", data={"onset_step": 3})
    assert sink.flush(timeout=30)
    with TestClient(create_app(Settings(db_url=url))) as client:
        page = client.get("/compare?run=r1&run=r2&run=r3").text
    figures = json.loads(page[page.index("const figures = ") + 16 : page.index(";\n  for")])
    names = [t["name"] for t in figures["chart-compare"]["data"]]
    assert names == ["r1", "r2", "r2: spikes", "r3"], names
    sink.close(timeout=30)
