"""A rollback's findings (cause, ranks, samples) are told wherever a verdict is: the console
line, the logbook, the alert, the run page (issue 39)."""

from __future__ import annotations

from datetime import UTC, datetime

from observatory.alerts import alert_body
from observatory.findings import findings
from observatory.logbook import _entry
from observatory.store.queries import EventRow

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
