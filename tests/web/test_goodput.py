"""The goodput planner's API and page (TestClient, an empty SQLite): the command's options in the
query string, figures from the simulation, bad options as 400 with the reason."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from spikewatch.observatory.goodput.cli import options, scenario_from_args
from spikewatch.observatory.goodput.study import study
from spikewatch.observatory.store import db
from spikewatch.web import charts
from spikewatch.web.app import create_app
from spikewatch.web.settings import Settings


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('goodput') / 'sw.db'}"
    db.upgrade(url)
    with TestClient(create_app(Settings(db_url=url))) as c:
        yield c


def test_the_api_answers_with_the_commands_options(client) -> None:
    r = client.get("/api/goodput", params={"gpus": "2048", "days": "10", "seeds": "6"})
    assert r.status_code == 200, r.text
    out = r.json()
    want = study(scenario_from_args(options({"gpus": "2048", "days": "10"})), seeds=6)
    assert out["curves"] == want["curves"]  # the page computes what the library computes
    assert list(out["plans"]) == list(want["plans"]) and len(out["plans"]) == 3
    for plan in out["plans"].values():
        assert 0 < plan["goodput"] < 1
        assert sum(plan["badput"].values()) == pytest.approx(1 - plan["goodput"], rel=1e-9)
    assert out["young_daly"]["daly_interval_s"] > 0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"gpus": "many"}, "invalid int"),
        ({"warp": "9"}, "unknown option"),
        ({"tiers": "memory"}, "disk"),
        ({"seeds": "5000"}, "between 1 and 200"),
        ({"run": "absent"}, "no run 'absent'"),
        ({"causes": "/etc/passwd"}, "unknown option 'causes'"),
        ({"from-run": "x"}, "unknown option 'from-run'"),
        ({"gpus": "100000000"}, "at most 1,000,000"),
        ({"seed": "-1"}, "seed must be >= 0"),
        ({"step-time": "0s"}, "step time must be > 0"),
    ],
)
def test_bad_options_are_400_with_the_reason(client, params, message) -> None:
    r = client.get("/api/goodput", params={**params, "seeds": params.get("seeds", "3")})
    assert r.status_code == 400 and message in r.json()["detail"]


def test_the_page_carries_both_figures(client) -> None:
    r = client.get("/goodput", params={"days": "5", "seeds": "4"})
    assert r.status_code == 200
    assert 'id="chart-goodput"' in r.text and 'id="chart-badput"' in r.text


def test_figures_are_built_from_the_study() -> None:
    s = study(scenario_from_args(options({"days": "5"})), seeds=4, points=5)
    fig = charts.goodput_curves_figure(s)
    lines = [t for t in fig["data"] if t.get("mode") == "lines+markers"]
    assert [t["y"] for t in lines] == [
        s["curves"]["disk"]["goodput"],
        s["curves"]["memory"]["goodput"],
    ]
    assert fig["layout"]["shapes"][0]["x0"] == pytest.approx(
        s["young_daly"]["daly_interval_s"] / 60
    )
    bars = charts.badput_figure(s)["data"]
    assert len(bars) == len(s["buckets"]) == 5
    first = list(s["plans"])[0]
    assert sum(b["y"][0] for b in bars) == pytest.approx(100 * (1 - s["plans"][first]["goodput"]))


def test_the_page_optimizes_and_takes_the_failure_modes(client) -> None:
    """`optimize=1` adds the best plan of a search (as `simulate --optimize` finds it, on fewer
    seeds) to the plans, within `memory-budget`; the failure modes are the command's options."""
    params = {"gpus": "2048", "days": "5", "seeds": "4", "sdc-rate": "llama3", "straggler": "0.05"}
    r = client.get("/api/goodput", params={**params, "optimize": "1", "memory-budget": "20"})
    assert r.status_code == 200, r.text
    out = r.json()
    best = [name for name in out["plans"] if name.startswith("best of")]
    assert len(best) == 1 and out["optimize"]["budget"] == 20
    assert out["plans"][best[0]]["goodput"] == max(g["goodput"] for g in out["optimize"]["grid"])
    assert {"wasted_progress_from_corruption", "straggler_slowdown"} <= set(out["buckets"])
    page = client.get("/goodput", params={**params, "optimize": "1"})
    assert page.status_code == 200 and 'id="optimized"' in page.text
    # issue 45, item 8: the page says its search is not the command's, and on which seeds the
    # plan as set was read (its row in the table is on the page's seeds)
    said = " ".join(page.text.split('id="optimized"')[1].split("</p>")[0].split())
    assert "5 × 5 intervals on 10 seeds" in said and "on the same 10 seeds" in said
    assert "searches 9 × 9 intervals on 30 seeds" in said
    assert f"other rows are on {out['seeds']} seeds" in said
    bad = client.get("/api/goodput", params={**params, "memory-budget": "0"})
    assert bad.status_code == 400 and "memory-budget" in bad.json()["detail"]


def test_the_badput_bars_labels_are_wrapped_and_given_room() -> None:
    """Issue 45, item 8: the search's best plan has a long name; as one line under its bar it
    was cut off."""
    from spikewatch.web.charts import badput_figure

    name = "best of 43 plans (10 seeds): memory every 35 steps (exponential:8), disk every 123"
    plans = {"as set": {"badput": {"restart": 0.01}}, name: {"badput": {"restart": 0.02}}}
    study = {"plans": plans, "buckets": ["restart"]}
    fig = badput_figure(study)
    labels = fig["data"][0]["x"]
    assert labels[0] == "as set" and labels[1].replace("<br>", " ") == name
    assert max(len(line) for label in labels for line in label.split("<br>")) <= 16
    assert fig["layout"]["xaxis"]["automargin"] is True
