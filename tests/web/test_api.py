"""The JSON API with TestClient over a store holding a run recorded by the rollback path."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from spikewatch.trainer.cli import main
from spikewatch.web.app import create_app
from spikewatch.web.settings import Settings

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

FAULT = 'faults=[{kind="shifted_labels", start=150, length=10}]'


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("web")
    db = f"sqlite:///{tmp / 'sw.db'}"
    args = [
        "train",
        "tiny_cpu",
        "--set",
        "train.progress=false",
        "--set",
        "train.max_steps=200",
        "--set",
        "checkpoint.interval=10",
        "--set",
        FAULT,
        "--run-dir",
        str(tmp / "r1"),
        "--db",
        db,
    ]
    assert main(args) == 0
    with TestClient(create_app(Settings(db_url=db))) as c:
        yield c


def test_runs_and_one_run(client) -> None:
    runs = client.get("/api/runs").json()
    assert [r["run_id"] for r in runs] == ["r1"]
    run = client.get("/api/runs/r1").json()
    assert run["spikes"] == 1 and run["rollbacks"] == 1 and run["branches"] == 2
    assert run["status"] == "completed" and run["last_step"] == 200


def test_series_keep_the_spike_in_every_branch(client) -> None:
    data = client.get(
        "/api/runs/r1/series", params={"metric": "train/loss", "branch": "all", "buckets": 50}
    ).json()
    assert {d["branch"] for d in data} == {0, 1}
    branch0 = next(d for d in data if d["branch"] == 0)
    peak = max(b["max_value"] for b in branch0["buckets"])
    assert peak > 5.0  # the poisoned batches' loss survives downsampling


def test_heatmaps(client) -> None:
    m = client.get("/api/runs/r1/matrix", params={"metric": "layer/*/attn/grad_norm"}).json()
    assert m["rows"] == [0, 1] and len(m["max_value"]) == 2
    h = client.get(
        "/api/runs/r1/matrix", params={"metric": "layer/*/head/*/attn_max", "layer": 1}
    ).json()
    assert h["rows"] == [0, 1, 2, 3]
    top = client.get(
        "/api/runs/r1/matrix", params={"metric": "layer/*/attn/grad_norm", "extremes": "max"}
    ).json()
    assert top["max_value"] == m["max_value"] and {v for r in top["min_value"] for v in r} == {None}


def test_run_page_charts_come_as_figures(client) -> None:
    page = client.get("/runs/r1").text
    charts = ["chart-loss", "chart-val", "chart-grad", "chart-lr", "chart-clip"]
    charts += ["heat-grad", "heat-update", "heat-attn", "heat-adam-m", "heat-adam-v", "heat-heads"]
    for chart in charts:
        assert f'id="{chart}"' in page  # each drawn from its own request
    assert '"type": "scatter"' not in page and '"heatmap"' not in page  # no figure data
    assert page.index("figures/${id}") < page.index("/static/plotly.min.js")  # asked for first
    fig = client.get("/api/runs/r1/figures/heat-attn").json()
    assert fig["data"][0]["type"] == "heatmap" and fig["data"][0]["y"] == [0, 1]
    heads = client.get("/api/runs/r1/figures/heat-heads", params={"layer": 1}).json()
    assert heads["data"][0]["y"] == [0, 1, 2, 3] and "layer 1" in heads["layout"]["title"]["text"]
    assert client.get("/api/runs/r1/figures/heat-nope").status_code == 422
    assert client.get("/api/runs/nope/figures/heat-attn").status_code == 404
    assert client.get("/api/runs/r1/figures/heat-heads", params={"layer": 9}).status_code == 404


def test_line_chart_figures_and_their_zoom(client) -> None:
    fig = client.get("/api/runs/r1/figures/chart-loss").json()
    names = [t["name"] for t in fig["data"]]
    assert "branch 0 (abandoned)" in names and "branch 1" in names and "spike onset" in names
    rollback = client.get("/api/runs/r1/events", params={"kind": "rollback"}).json()[0]
    to = rollback["data"]["to_step"]
    (a, b), = rollback["data"]["skip_ranges"]  # fmt: skip
    note = f"rollback → step {to}, skipping batches [{a}, {b})"
    assert [a["text"] for a in fig["layout"]["annotations"]] == [note]
    marks = {(x["type"], x["x0"]) for x in fig["layout"]["shapes"]}
    assert {("line", rollback["step"]), ("line", to), ("rect", to)} <= marks  # restored: marked
    live = next(t for t in fig["data"] if t["name"] == "branch 1")
    after = [y for x, y in zip(live["x"], live["y"], strict=True) if x > to]
    assert max(after) < 5.0  # the spike belongs to the abandoned branch only
    gone = next(t for t in fig["data"] if t["name"] == "branch 0 (abandoned)")
    assert min(gone["x"]) > to and max(gone["y"]) > 5.0  # its own steps, the spike among them
    assert live["x"][0] < to  # the steps both branches share are the live history's
    # zoomed: every step of the window is its own bucket, spike markers and notes stay
    zoom = client.get(
        "/api/runs/r1/figures/chart-loss", params={"start": 140, "end": 170, "buckets": 1000}
    ).json()
    lines = [t for t in zoom["data"] if t["mode"] == "lines"]
    assert all(140 <= x <= 170 for t in lines for x in t["x"])
    live = next(t for t in lines if t["name"] == "branch 1")
    assert live["x"] == list(range(140, 171))  # the history: branch 0's up to the fork
    assert "spike onset" in [t["name"] for t in zoom["data"]]
    # the learning rate has no spike markers, only the rollback
    lr = client.get("/api/runs/r1/figures/chart-lr", params={"buckets": 10}).json()
    shown = [t for t in lr["data"] if t.get("showlegend", True)]  # (the run's end: hidden)
    assert [t["name"] for t in shown] == ["branch 1", "branch 0 (abandoned)"]
    # 10 buckets a branch: a min and a max each (the live history holds both branches' own)
    assert len(shown[0]["x"]) <= 40 and len(shown[1]["x"]) <= 20
    assert client.get("/api/runs/r1/figures/chart-loss", params={"buckets": 0}).status_code == 422
    bad = client.get("/api/runs/r1/figures/chart-loss", params={"start": -1})
    assert bad.status_code == 422


def test_events_branches_checkpoints_logbook(client) -> None:
    kinds = [e["kind"] for e in client.get("/api/runs/r1/events").json()]
    assert "spike" in kinds and "rollback" in kinds
    only = client.get("/api/runs/r1/events", params={"kind": "rollback"}).json()
    assert [e["kind"] for e in only] == ["rollback"] and only[0]["data"]["to_step"] < 151
    unknown = client.get("/api/runs/r1/events", params={"kind": "true"})  # schemathesis found
    assert unknown.status_code == 422  # the kinds are the schema's enum
    assert [b["number"] for b in client.get("/api/runs/r1/branches").json()] == [0, 1]
    assert client.get("/api/runs/r1/checkpoints").json()
    assert client.get("/api/runs/r1/logbook").text.startswith("# Logbook of run `r1`")


def test_unknown_run_is_404_with_a_message(client) -> None:
    r = client.get("/api/runs/nope")
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    assert client.get("/api/runs/nope/series", params={"metric": "train/loss"}).status_code == 404


def test_malformed_queries_are_422(client) -> None:
    assert client.get("/api/runs/r1/series").status_code == 422  # metric missing
    bad = client.get("/api/runs/r1/series", params={"metric": "train/loss", "buckets": 0})
    assert bad.status_code == 422
    assert client.get("/api/runs", params={"limit": -1}).status_code == 422


def test_openapi_docs(client) -> None:
    spec = client.get("/openapi.json").json()
    assert "/api/runs/{run_id}/series" in spec["paths"]
    assert client.get("/docs").status_code == 200


def test_plotly_js_comes_from_the_package_and_is_cached() -> None:
    from fastapi.testclient import TestClient as Client

    from spikewatch.web.app import create_app
    from spikewatch.web.routes.pages import PLOTLY_JS
    from spikewatch.web.settings import Settings

    with Client(create_app(Settings(db_url="sqlite://"))) as c:
        r = c.get("/static/plotly.min.js")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/javascript")
    assert r.headers["cache-control"] == "public, max-age=86400"
    # the installed package's file, behind V8's compile hint
    hint = b"//# allFunctionsCalledOnLoad\n"
    assert r.content.startswith(hint) and r.content[len(hint) :] == PLOTLY_JS.read_bytes()


def test_runs_page_filters_by_tag(client) -> None:
    assert "r1" in client.get("/").text
    assert "/runs/r1" not in client.get("/", params={"tag": "nope"}).text


def test_the_run_page_needs_no_emoji_font(client) -> None:
    """Issue 45: the pin glyph showed as a box where no emoji font exists; pinned checkpoints are
    marked in words, and the page holds no character outside the Basic Multilingual Plane."""
    page = client.get("/runs/r1").text
    assert "&#128204;" not in page and not [c for c in page if ord(c) > 0xFFFF]
    kept = page[page.index('id="ckpt-kept"') :].split("</p>")[0]
    pinned = kept.count(", pinned)")  # in each checkpoint's title
    assert pinned >= 1 and kept.count('<sup class="pin">pinned</sup>') == pinned
