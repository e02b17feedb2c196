"""A Hugging Face run recorded through spikewatch.hf is shown like a native one: every chart of
the run page, the heatmaps under the model's own module names, the intervention."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from fastapi.testclient import TestClient  # noqa: E402

from spikewatch.web.app import create_app  # noqa: E402
from spikewatch.web.settings import Settings  # noqa: E402

from .conftest import run_example  # noqa: E402

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)


def test_a_hf_run_on_the_run_page(tmp_path) -> None:
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    args = ("--steps", "60", "--poison-at", "40", "--poison-len", "14", "--db", db)
    summary = run_example("hf_trainer", tmp_path, *args)
    run_id = summary["run_id"]
    with TestClient(create_app(Settings(db_url=db))) as client:
        page = client.get(f"/runs/{run_id}").text
        charts = ["chart-loss", "chart-val", "chart-grad", "chart-lr", "chart-clip"]
        charts += ["heat-grad", "heat-update", "heat-attn", "heat-adam-m", "heat-adam-v"]
        for chart in [*charts, "heat-heads"]:
            assert f'id="{chart}"' in page, chart
        assert "rollback" in page
        grad = client.get(f"/api/runs/{run_id}/figures/heat-grad").json()
        assert grad["data"][0]["type"] == "heatmap" and grad["data"][0]["y"] == [0, 1]
        heads = client.get(f"/api/runs/{run_id}/figures/heat-heads", params={"layer": 1}).json()
        assert heads["data"][0]["y"] == [0, 1, 2, 3]
        run = client.get(f"/api/runs/{run_id}").json()
        assert run["config"]["framework"] == "hf" and run["config"]["model"]["n_layer"] == 2
