"""The compare page and the sweeps API over a sweep group (TestClient, fresh SQLite)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from spikewatch.observatory import store
from spikewatch.observatory.reports.sweeps import register_sweep
from spikewatch.observatory.store import db
from spikewatch.observatory.store.sink import DbSink
from spikewatch.web.app import create_app
from spikewatch.web.settings import Settings

SPEC = {"variants": ["baseline", "qk_norm"], "lrs": [0.01, 0.1], "seeds": [0]}
HYPOTHESIS = "QK-norm keeps the peak attention logit bounded"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    url = f"sqlite:///{tmp / 'sw.db'}"
    db.upgrade(url)
    with store.session_factory(url)() as s:
        register_sweep(s, name="grid", spec=SPEC, hypothesis=HYPOTHESIS)
    peaks = {("baseline", 0.01): 9.0, ("baseline", 0.1): 700.0, ("qk_norm", 0.01): 4.0}
    with DbSink(url, spool_dir=tmp / "spool", linger_s=0.01) as sink:
        for (variant, lr), peak in peaks.items():
            run = f"{variant}-{lr:g}"
            sink.start_run(
                run,
                name="tiny",
                config={
                    "optim": {"lr": lr},
                    "train": {"seed": 0},
                    "data": {"batch_size": 4, "seq_len": 8},
                },
                tags=[f"variant={variant}", f"lr={lr:g}", "seed=0"],
                sweep_group="grid",
            )
            for step in range(1, 21):
                loss = 5.5 if step == 1 else 3.0 - lr
                sink.log_metrics(run, 0, step, {"train/loss": loss, "layer/0/attn_max": peak})
            sink.log_metrics(run, 0, 20, {"val/loss": 3.0 - lr})
            sink.set_status(run, "completed")
        assert sink.flush(30)
    with TestClient(create_app(Settings(db_url=url))) as c:
        yield c


def test_sweeps_api(client) -> None:
    sweeps = client.get("/api/sweeps").json()
    assert [s["name"] for s in sweeps] == ["grid"] and sweeps[0]["hypothesis"] == HYPOTHESIS
    report = client.get("/api/sweeps/grid").json()
    assert report["lrs"] == [0.01, 0.1]
    base, qk = report["variants"]
    assert base["peak_by_lr"] == [9.0, 700.0] and qk["peak_by_lr"] == [4.0, None]
    assert base["lr_sensitivity"] == pytest.approx((2.99 + 2.9) / 2 - 2.9)
    assert qk["lr_sensitivity"] is None and (qk["done"], qk["total"]) == (1, 2)
    pending = [c for c in report["cells"] if c["status"] == "pending"]
    assert [(c["variant"], c["lr"]) for c in pending] == [("qk_norm", 0.1)]
    census = [(r["variant"], r["lr"], r["runs"]) for r in report["census"]]
    assert census == [("baseline", 0.01, 1), ("baseline", 0.1, 1), ("qk_norm", 0.01, 1)]
    ran = [c for c in report["cells"] if c["run_id"]]
    assert all(c["census"]["steps"] == c["last_step"] for c in ran)
    assert all(c["census"]["loss_spikes_per_1k"] is not None for c in ran)
    missing = client.get("/api/sweeps/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["detail"]


def test_every_store_field_is_served(client) -> None:
    """The API's shapes are the store's dataclasses: the sweep's grid (`spec`, which a
    hand-written shape once dropped) is served, and every dataclass field has its shape's."""
    from dataclasses import fields

    from spikewatch.web import schemas

    report = client.get("/api/sweeps/grid").json()
    assert report["spec"]["variants"] == ["baseline", "qk_norm"]
    assert all("diverged" in c for c in report["cells"])  # a property, served too
    for dc, model in schemas._SHAPES.items():
        assert {f.name for f in fields(dc)} <= set(model.model_fields), dc.__name__


def test_compare_page_of_a_group_shows_the_hypothesis_and_the_lr_table(client) -> None:
    page = client.get("/compare", params={"group": "grid"})
    assert page.status_code == 200
    html = page.text
    assert "Pre-registered hypothesis" in html and HYPOTHESIS in html
    assert 'id="lr-table"' in html and "700.0" in html and "pending" in html
    assert 'id="census-table"' in html and "gradient spikes" in html
    for chart in ("chart-compare", "chart-logits", "chart-lr-loss", "chart-lr-peak"):
        assert f'id="{chart}"' in html
    assert client.get("/compare", params={"group": "nope"}).status_code == 404
    assert client.get("/compare", params={"align": "sideways"}).status_code == 422


def test_compare_by_tokens_scales_the_x_axis(client) -> None:
    html = client.get("/compare", params={"run": ["baseline-0.01"], "align": "tokens"}).text
    assert '"text": "tokens"' in html or '"text":"tokens"' in html
    assert client.get("/compare", params={"run": ["no-such-run"]}).status_code == 404


def test_the_compare_page_costs_the_same_statements_for_1_or_3_runs(client) -> None:
    """Cells, series and max-logit panels are read for all chosen runs at once: the page's
    statement count does not grow with the runs."""
    from sqlalchemy import event

    engine = client.app.state.sessions.kw["bind"]
    statements: list[str] = []

    def listen(conn, cursor, statement, *rest) -> None:  # noqa: ANN001
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", listen)
    try:
        counts = {}
        for query in ("run=baseline-0.01", "run=baseline-0.01&run=baseline-0.1&run=qk_norm-0.01"):
            client.get(f"/compare?{query}")  # warm: the connection's own set-up, once
            statements.clear()
            page = client.get(f"/compare?{query}")
            assert page.status_code == 200
            counts[query.count("run=")] = len(statements)
    finally:
        event.remove(engine, "before_cursor_execute", listen)
    # 31 today (3 of them the census, 1 the runs' spikes for their markers), any runs
    assert counts[1] == counts[3] <= 31, counts
    assert "chart-logits" in page.text and "qk_norm-0.01" in page.text
