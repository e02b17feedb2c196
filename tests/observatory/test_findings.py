"""A rollback's findings (cause, ranks, samples) are told wherever a verdict is: the console
line, the logbook, the alert, the run page (issue 39)."""

from __future__ import annotations

from datetime import UTC, datetime

from spikewatch.observatory.alerts import alert_body
from spikewatch.observatory.findings import findings
from spikewatch.observatory.reports.logbook import _entry
from spikewatch.observatory.store.queries import EventRow

DATA = {
    "from_step": 203,
    "to_step": 190,
    "skip_ranges": [[199, 213]],
    "lr_scale": 1.0,
    "cause": "data_x_state",
    "ranks": [1],
    "samples": [{"batch": 200, "row": 0}, {"batch": 200, "row": 1}, {"batch": 201, "row": 0}],
    "attribution": {"rows": 224, "clear": True},
}


def test_the_phrase_names_cause_ranks_and_samples() -> None:
    text = findings(DATA)
    assert "cause: the data" in text and "rank 1 departed" in text
    assert "3 of 224 rows named: batch 200 rows 0,1; batch 201 rows 0" in text
    assert findings({}) == ""
    assert "no row of 64 stands out" in findings({"attribution": {"rows": 64}, "samples": []})


def test_the_logbook_and_the_alert_tell_them() -> None:
    event = EventRow("u", 0, 203, "rollback", "trainer", "loss spike", DATA, datetime.now(UTC))
    entry = _entry(event)
    assert entry is not None and "rank 1 departed" in entry and "rows named" in entry
    event_dict = {"run_id": "r", "kind": "rollback", "step": 203, "message": "spike", "data": DATA}
    body = alert_body("http://127.0.0.1:9/hook", event_dict)
    assert "rank 1 departed" in body["text"] and "3 of 224 rows named" in body["text"]


def test_a_rank_whose_spikes_keep_coming_without_a_data_cause_is_flagged(tmp_path) -> None:
    """On the run page (and in the rollback's findings, so in the alert): rank 1 twice named
    by rollbacks whose replay found the device's fault."""
    from fastapi.testclient import TestClient

    from spikewatch.observatory.findings import suspect_devices
    from spikewatch.observatory.store.db import upgrade
    from spikewatch.observatory.store.sink import DbSink
    from spikewatch.web.app import create_app
    from spikewatch.web.settings import Settings

    device = {"cause": "device", "ranks": [1], "device_ranks": [1], "to_step": 5}
    assert suspect_devices([device, {"cause": "data_x_state", "ranks": [1]}]) == {}
    assert suspect_devices([device, {**device, "suspect_devices": [1]}]) == {1: 2}
    assert "rank(s) 1: a suspect device" in findings({**device, "suspect_devices": [1]})
    url = f"sqlite:///{tmp_path / 'x.db'}"
    upgrade(url)
    with DbSink(url, spool_dir=tmp_path / "spool", linger_s=0.01) as sink:
        sink.start_run("r", config={})
        for step in (10, 30):
            sink.log_event("r", "rollback", step=step, message="spike", data=device)
    with TestClient(create_app(Settings(db_url=url))) as client:
        page = client.get("/runs/r").text
    assert "Suspect devices" in page and "rank 1 (2 spikes there without a data cause)" in page


def test_an_lr_cut_is_said_wherever_the_rollback_is_told() -> None:
    """A rollback that cuts the learning rate says so in its findings, so in the console line,
    the logbook and the alert (it was only a table column and the LR chart)."""
    cut = {**DATA, "lr_scale": 0.5, "lr_scale_after": 0.25, "lr_cut": "the spike came back"}
    text = findings(cut)
    assert text.startswith("the learning rate cut x0.5 from now on (x0.25 of its schedule in all)")
    assert "the spike came back" in text
    assert "learning rate" not in findings(DATA)  # no cut: nothing said
    event = EventRow("u", 0, 203, "rollback", "trainer", "loss spike", cut, datetime.now(UTC))
    assert "learning rate cut x0.5" in (_entry(event) or "")
    body = alert_body("http://127.0.0.1:9/hook", {"run_id": "r", "kind": "rollback", "data": cut})
    assert "learning rate cut x0.5" in body["text"]
