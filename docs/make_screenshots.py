"""Screenshots of the run page and the compare page for README.md (docs/*.png).

    python docs/make_screenshots.py DB_URL RUN_ID [COMPARE_RUN ...]
    python docs/make_screenshots.py DB_URL --group GROUP [--page-only]
    python docs/make_screenshots.py DB_URL --page PATH FILE.png=ELEMENT_ID ...

The first form shoots the run page and the compare page of the given runs. The second shoots
a sweep group's compare page (compare_page.png) and exports its charts, as the dashboard's
chart functions draw them, for docs/ablations.md (ablation_*.png; `--page-only`: the page
alone, for a sweep other than that study's). The third opens any page of
the dashboard (`/runs/RUN_ID`, `/compare?group=G`) and saves the listed elements (a chart's or a
table's id) as docs/FILE.png, for docs/spikes.md.
Serves the dashboard on a free local port and drives Debian's Chromium with Playwright.
"""

from __future__ import annotations

import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

from spikewatch.observatory.serving import serve_in_thread
from spikewatch.web.app import create_app
from spikewatch.web.settings import Settings

ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


SWEEP_CHARTS = {
    "chart-lr-loss": "ablation_lr_loss.png",
    "chart-lr-peak": "ablation_lr_peak.png",
    "chart-logits": "ablation_max_logits.png",
    "chart-compare": "ablation_loss_curves.png",
}


def shoot_group(page, base: str, group: str, out: Path, charts: bool = True) -> None:
    page.goto(f"{base}/compare?group={group}")
    page.wait_for_selector("#chart-lr-loss .main-svg")
    page.wait_for_timeout(800)
    page.screenshot(path=str(out / "compare_page.png"), full_page=False)
    for chart, name in SWEEP_CHARTS.items() if charts else ():
        page.locator(f"#{chart}").screenshot(path=str(out / name))


def shoot_elements(page, base: str, path: str, wanted: list[str], out: Path) -> None:
    page.goto(f"{base}{path}")
    for item in wanted:
        name, _, element = item.partition("=")
        if element.startswith(("chart-", "heat-")):
            page.wait_for_selector(f"#{element} .main-svg")
    page.wait_for_timeout(800)
    for item in wanted:
        name, _, element = item.partition("=")
        page.locator(f"#{element}").screenshot(path=str(out / name))


def main() -> None:
    if sys.argv[2] == "--page":
        db, _, path, *wanted = sys.argv[1:]
        served = serve_in_thread(create_app(Settings(db_url=db)))
        assert served is not None
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            shoot_elements(page, served.url, path, wanted, Path(__file__).parent)
            browser.close()
        served.stop()
        return
    if sys.argv[2] == "--group":
        db, _, group = sys.argv[1:4]
        run, others = None, []
    else:
        db, run, *others = sys.argv[1:]
        group = None
    served = serve_in_thread(create_app(Settings(db_url=db)))
    assert served is not None
    base = served.url
    out = Path(__file__).parent
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        if group is not None:
            shoot_group(page, base, group, out, charts="--page-only" not in sys.argv)
            browser.close()
            served.stop()
            return
        page.goto(f"{base}/runs/{run}")
        page.wait_for_selector("#chart-loss .main-svg")
        page.wait_for_timeout(800)
        page.screenshot(path=str(out / "run_page.png"), full_page=False)
        query = "&".join(f"run={r}" for r in [run, *others])
        page.goto(f"{base}/compare?{query}")
        page.wait_for_selector("#chart-compare .main-svg")
        page.wait_for_timeout(500)
        page.screenshot(path=str(out / "compare_page.png"), full_page=False)
        browser.close()
    served.stop()


if __name__ == "__main__":
    main()
