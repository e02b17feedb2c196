"""The goodput page at the speed of a question (issue 40): changing one control of the form
redraws the charts and the plans in place (the page fetches /goodput/view; plotly.js stays
loaded), timed in Chromium from the click until the redraw, each time a value not seen yet (its
study: 24 plans x 30 seeds), alternately the disk interval (the disk-alone curve's plans come
from the page's plan cache) and the GPU count (every plan simulated again). Also the first load
of the page (plain Chromium over the DevTools pipe, benchmarks/_cdp.py, a fresh context each
time) beside the floor, a page that only loads plotly.js and draws one chart; and what
`GET /api/goodput` takes with its defaults (in-process, uncached plans).

    python benchmarks/goodput_page.py [--reps 6]

Last line: {"redraw_s": median, "redraw_disk_interval_s": median, "redraw_gpus_s": median,
"floor_s": median, "api_defaults_s": median, ...}.
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
sys.path.insert(0, str(Path(__file__).parents[1]))
from _cdp import ARGS, Chromium  # noqa: E402
from _common import machine  # noqa: E402
from dashboard import FLOOR  # noqa: E402
from fastapi.responses import HTMLResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from spikewatch.observatory.serving import serve_in_thread  # noqa: E402
from spikewatch.observatory.store import db  # noqa: E402
from spikewatch.web.app import create_app  # noqa: E402
from spikewatch.web.settings import Settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args()
    print(json.dumps(machine()))  # noqa: T201
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'x.db'}"
        db.upgrade(url)
        app = create_app(Settings(db_url=url))
        app.add_api_route("/bench/floor", lambda: HTMLResponse(FLOOR), include_in_schema=False)
        client = TestClient(app)
        api = []
        for i in range(3):  # the defaults, a fresh seed each: no cached plan
            t = time.perf_counter()
            assert client.get("/api/goodput", params={"seed": str(100 + i)}).status_code == 200
            api.append(time.perf_counter() - t)
        served = serve_in_thread(app)
        assert served is not None
        chromium = Chromium()
        load, floor = [], []
        try:  # a fresh page (the first question), interleaved with the plotly.js floor
            for i in range(3):
                load.append(chromium.render_ms(f"{served.url}/goodput?seed={200 + i}") / 1e3)
                floor.append(chromium.render_ms(f"{served.url}/bench/floor") / 1e3)
        finally:
            chromium.close()
        redraw = []
        with sync_playwright() as p:  # then each control changed: redrawn in place
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{served.url}/goodput")
            page.wait_for_selector("#chart-badput .main-svg")
            kinds: dict[str, list[float]] = {"disk-interval": [], "gpus": []}
            for i in range(2 * args.reps):  # each time a value not yet seen
                # the disk interval leaves the disk-alone curve as it was (its plans come from
                # the page's plan cache); the GPU count moves every plan (nothing reused)
                name = "disk-interval" if i % 2 == 0 else "gpus"
                page.fill(f"input[name={name}]", str(450 + i if i % 2 == 0 else 16_000 - 64 * i))
                t = time.perf_counter()
                page.click("#goodput-form button")
                page.wait_for_function(f"document.body.dataset.redrawn === '{i + 1}'")
                redraw.append(time.perf_counter() - t)
                kinds[name].append(redraw[-1])
            browser.close()
        served.stop()
    out = {
        "redraw_s": statistics.median(redraw),
        "first_load_s": statistics.median(load),
        "floor_s": statistics.median(floor),
        "api_defaults_s": statistics.median(api),
        "redraws_s": redraw,
        "redraw_disk_interval_s": statistics.median(kinds["disk-interval"]),
        "redraw_gpus_s": statistics.median(kinds["gpus"]),
    }
    out["redraw_vs_target"] = out["redraw_s"] / 1.0
    print(  # noqa: T201
        f"redraw after one control: {out['redraw_s']:.2f} s ({out['redraw_vs_target']:.2f}x "
        f"the 1 s target; the disk interval {out['redraw_disk_interval_s']:.2f} s, the GPU "
        f"count {out['redraw_gpus_s']:.2f} s); the first load {out['first_load_s']:.2f} s "
        f"(plotly.js alone {out['floor_s']:.2f} s); GET /api/goodput defaults "
        f"{out['api_defaults_s']:.2f} s"
    )
    print(json.dumps(out))  # noqa: T201


if __name__ == "__main__":
    main()
