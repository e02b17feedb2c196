"""Control endpoints need the bearer token; without it nothing is written."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from spikewatch.observatory import store
from spikewatch.observatory.store.queries import session_factory
from spikewatch.web.app import create_app
from spikewatch.web.settings import Settings

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

BODY = {"text": "data pipeline restarted here", "step": 120}


@pytest.fixture
def clients(recorded_db):
    with (
        TestClient(create_app(Settings(db_url=recorded_db, token="s3cret"))) as on,
        TestClient(create_app(Settings(db_url=recorded_db))) as off,
    ):
        yield on, off


def _annotations(db: str) -> list[str]:
    with session_factory(db)() as s:
        return [e.message for e in store.events(s, run_id="spiky", kinds=["annotation"])]


def test_without_or_with_a_wrong_token_nothing_happens(clients, recorded_db) -> None:
    on, off = clients
    before = _annotations(recorded_db)
    assert on.post("/api/runs/spiky/annotations", json=BODY).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert on.post("/api/runs/spiky/annotations", json=BODY, headers=bad).status_code == 403
    ok = {"Authorization": "Bearer s3cret"}
    assert off.post("/api/runs/spiky/annotations", json=BODY, headers=ok).status_code == 403
    assert _annotations(recorded_db) == before


def test_an_annotation_is_stored_and_shown(clients, recorded_db) -> None:
    on, _ = clients
    ok = {"Authorization": "Bearer s3cret"}
    r = on.post("/api/runs/spiky/annotations", json=BODY, headers=ok)
    assert r.status_code == 201 and r.json()["uid"]
    assert BODY["text"] in _annotations(recorded_db)
    assert on.post("/api/runs/nope/annotations", json=BODY, headers=ok).status_code == 404
    assert on.post("/api/runs/spiky/annotations", json={"text": ""}, headers=ok).status_code == 422


def test_a_running_training_obeys_rollback_and_stop_requests(tmp_path) -> None:
    import json
    import threading
    import time

    from spikewatch.observatory.store.db import upgrade
    from spikewatch.trainer.cli import main

    db = f"sqlite:///{tmp_path / 'live.db'}"
    upgrade(db)  # as `spikewatch serve` does before it serves
    out = tmp_path / "s.json"
    args = [
        "train",
        "tiny_cpu",
        "--set",
        "train.progress=false",
        "--set",
        "train.max_steps=3000",
        "--set",
        "checkpoint.interval=10",
        "--set",
        "eval.interval=none",
        "--db",
        db,
        "--run-dir",
        str(tmp_path / "live"),
        "--summary-json",
        str(out),
    ]
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(main(args)))
    t.start()
    ok = {"Authorization": "Bearer s3cret"}
    with TestClient(create_app(Settings(db_url=db, token="s3cret"))) as client:

        def last_step() -> int:
            r = client.get("/api/runs/live")
            return (r.json()["last_step"] or 0) if r.status_code == 200 else 0

        deadline = time.monotonic() + 60
        while last_step() < 60 and time.monotonic() < deadline:
            time.sleep(0.2)
        r = client.post(
            "/api/runs/live/requests", json={"action": "rollback", "to_step": 25}, headers=ok
        )
        assert r.status_code == 202
        time.sleep(3)
        assert (
            client.post("/api/runs/live/requests", json={"action": "stop"}, headers=ok).status_code
            == 202
        )
        t.join(timeout=120)
        assert rc == [0]
        summary = json.loads(out.read_text())
        # the dashboard's rollback: the run's own same-step refusal (a clean tiny run has one
        # near step 70) may come before it, as the request lands when it lands
        last = summary["interventions"][-1]
        first = next(i for i in summary["interventions"] if i["kind"] == "rollback")
        assert "dashboard" in first["reason"]
        assert first["to_step"] <= 25  # the newest checkpoint retained at or before step 25
        assert first["from_step"] >= 60
        assert last["kind"] == "halt" and "dashboard" in summary["halted"]
        assert summary["steps"] < 3000
        refused = client.post("/api/runs/live/requests", json={"action": "stop"}, headers=ok)
        assert refused.status_code == 409  # the run is over


def test_a_read_token_closes_the_pages_and_the_api(recorded_db) -> None:
    app = create_app(Settings(db_url=recorded_db, read_token="r3ad", token="s3cret"))
    with TestClient(app) as c:
        assert c.get("/api/runs").status_code == 401
        assert c.get("/").status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer r3ad"}).status_code == 200
        assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert (
            c.get("/static/plotly.min.js", headers={"Authorization": "Bearer r3ad"}).status_code
            == 200
        )
