"""Control endpoints need the bearer token; without it nothing is written."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from observatory import store
from observatory.store import session_factory
from web.app import create_app
from web.settings import Settings

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
