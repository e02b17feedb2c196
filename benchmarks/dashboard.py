"""Run-page data for a big run: API p95 per chart request the run page makes, and the page's
render time in Chromium.

A run with 1M points in each line series (train/loss, val/loss, grad norm, LR, clip factor)
and 48 layers x 20k steps in each heatmap metric (plus 12 heads of layer 0), written straight
through the store's writer. Then:

- each figure request of the run page timed (p95 over repetitions; line charts at 2000
  buckets, the most the page asks for);
- the run page opened in Debian's Chromium, from navigation until every chart has drawn, in a
  fresh browser context each time: in plain Chromium driven over the DevTools pipe without the
  Runtime domain (benchmarks/_cdp.py: what a user's browser does), and under Playwright, whose
  instrumentation adds about 0.5 s to evaluating plotly.js;
- the floor, interleaved with the run page: a page that only loads plotly.js and draws one chart.

Last line: {"api_p95_ms": worst chart p95, "render_s": plain Chromium median, ...}.

    python benchmarks/dashboard.py [--points 1000000] [--layers 48] [--reps 10]

(Not benchmarks/web.py as issue 7 names it: run as a script, that file would shadow the `web`
package it measures.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import numpy as np  # noqa: E402
from _cdp import ARGS, Chromium  # noqa: E402
from _common import machine  # noqa: E402
from fastapi.responses import HTMLResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from spikewatch.observatory.serving import serve_in_thread  # noqa: E402
from spikewatch.observatory.store import db  # noqa: E402
from spikewatch.observatory.store.ingest import Writer  # noqa: E402
from spikewatch.observatory.store.records import Record  # noqa: E402
from spikewatch.web.app import create_app  # noqa: E402
from spikewatch.web.settings import Settings  # noqa: E402

LINES = ["train/loss", "val/loss", "optim/grad_norm", "optim/lr", "optim/clip_factor"]
HEATS = ["layer/{i}/attn/grad_norm", "layer/{i}/attn/update_ratio", "layer/{i}/attn_max"]


def populate(url: str, points: int, layers: int, heat_steps: int, heads: int = 12) -> None:
    db.upgrade(url)
    w = Writer(db.make_engine(url, writer=True))
    w.write([Record("run", "big", {"status": "running", "config": {}, "tags": []})])
    rng = np.random.default_rng(0)
    steps = np.arange(points)
    for metric in LINES:
        values = 2 + 0.1 * rng.standard_normal(points)
        values[points // 3] = 50.0  # a one-step spike every chart must still draw
        w.write_series("big", 0, metric, steps, values)
    hsteps = np.arange(heat_steps)
    for template in HEATS:
        for i in range(layers):
            w.write_series("big", 0, template.format(i=i), hsteps, rng.random(heat_steps) + i)
    for i in range(layers if heads > 12 else 1):  # a 70B shape: every head of every layer
        for h in range(heads):
            values = rng.random(heat_steps)
            w.write_series("big", 0, f"layer/{i}/head/{h}/attn_max", hsteps, values)


def api_times(client: TestClient, reps: int) -> dict[str, float]:
    """p95 of each figure request the run page makes. Line charts ask for one bucket per device
    pixel of their width (676 in a 1400 px window); timed here at the most they ask, 2000."""
    requests = {
        chart: (f"/api/runs/big/figures/{chart}", {"buckets": 2000})
        for chart in ("chart-loss", "chart-val", "chart-grad", "chart-lr", "chart-clip")
    }
    requests |= {
        chart: (f"/api/runs/big/figures/{chart}", {})
        for chart in ("heat-grad", "heat-update", "heat-attn", "heat-heads")
    }
    requests["heat-heads (another layer)"] = ("/api/runs/big/figures/heat-heads", {"layer": 1})
    out = {}
    for name, (path, params) in requests.items():
        client.get(path, params=params).raise_for_status()  # warm
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            client.get(path, params=params).raise_for_status()
            ts.append(time.perf_counter() - t0)
        ts.sort()
        out[name] = 1e3 * ts[min(len(ts) - 1, int(0.95 * len(ts)))]
    return out


FLOOR = """<!doctype html><html><head><script src="/static/plotly.min.js"></script></head>
<body><div class="chart" id="c"></div><script>Plotly.newPlot("c", [{y: [1, 3, 2]}]);</script>
</body></html>"""


def render_times(url: str, reps: int) -> dict[str, float]:
    """Median seconds until every chart of the run page has drawn: in plain Chromium (what a
    user's browser does), under Playwright (instrumented; the figure earlier sessions
    reported), and the floor: a page that only loads plotly.js and draws one chart."""
    app = create_app(Settings(db_url=url))
    app.add_api_route("/bench/floor", lambda: HTMLResponse(FLOOR), include_in_schema=False)
    served = serve_in_thread(app)
    assert served is not None
    base = served.url
    plain: dict[str, list[float]] = {"run": [], "floor": []}
    chromium = Chromium()
    try:
        for _ in range(reps):  # interleaved, so a noisy neighbour hits both alike
            plain["run"].append(chromium.render_ms(f"{base}/runs/big") / 1e3)
            plain["floor"].append(chromium.render_ms(f"{base}/bench/floor") / 1e3)
    finally:
        chromium.close()
    instrumented = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        for _ in range(reps):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            t0 = time.perf_counter()
            page.goto(f"{base}/runs/big")
            page.wait_for_function(
                "[...document.querySelectorAll('.chart')].every(d => d.querySelector('.main-svg'))",
                timeout=60000,
            )
            instrumented.append(time.perf_counter() - t0)
            page.close()
        browser.close()
    served.stop()
    return {
        "render_s": statistics.median(plain["run"]),
        "plotly_floor_s": statistics.median(plain["floor"]),
        "render_playwright_s": statistics.median(instrumented),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", type=int, default=1_000_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--heat-steps", type=int, default=20_000)
    ap.add_argument("--heads", type=int, default=12, help="per layer (above 12: every layer)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    print("machine:", json.dumps(machine()))
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'web.db'}"
        t0 = time.perf_counter()
        populate(url, args.points, args.layers, args.heat_steps, args.heads)
        print(f"populated in {time.perf_counter() - t0:.0f} s")
        with TestClient(create_app(Settings(db_url=url))) as client:
            per_chart = api_times(client, args.reps)
        for name, ms in per_chart.items():
            print(f"{name:>32}: p95 {ms:.1f} ms")
        render = render_times(url, max(5, args.reps // 2))
        print(
            f"run page draws every chart in {render['render_s']:.2f} s in Chromium "
            f"({render['render_playwright_s']:.2f} s under Playwright); "
            f"plotly.js alone and one chart: {render['plotly_floor_s']:.2f} s"
        )
        print(
            json.dumps(
                {
                    "api_p95_ms": max(per_chart.values()),
                    **render,
                    "render_over_floor": render["render_s"] / render["plotly_floor_s"],
                    "per_chart_p95_ms": per_chart,
                }
            )
        )


if __name__ == "__main__":
    main()
