"""One store the dashboard finds: a run started without `db` lands in runs/spikewatch.db where
it was started, says so in one line, and `spikewatch serve` started there without --db lists it
(the dashboard's own app, as the CLI builds it, read over HTTP)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from .conftest import run_example

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


@pytest.mark.parametrize("framework", ["plain_loop", "hf_trainer"])
def test_serve_without_db_lists_the_run_started_here(framework, tmp_path, monkeypatch, caplog):
    if framework == "hf_trainer":
        pytest.importorskip("transformers", reason="the hf extra is not installed")
    monkeypatch.delenv("SPIKEWATCH_DB_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO", logger="spikewatch.trainer"):
        summary = run_example(framework, tmp_path, "--steps", "12")
    db = tmp_path / "runs" / "spikewatch.db"
    assert db.is_file()
    err = "\n".join(caplog.messages)
    assert f"run {summary['run_id']} is recorded in sqlite:///{db}" in err
    assert "see it: spikewatch serve  (from this directory)" in err
    assert "rollback checkpoints:" in err

    from spikewatch.web.app import create_app
    from spikewatch.web.settings import Settings

    with TestClient(create_app(Settings())) as client:  # what `spikewatch serve` builds
        runs = client.get("/api/runs").json()
    assert [r["run_id"] for r in runs] == [summary["run_id"]]
