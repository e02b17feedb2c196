"""The pages in a real browser: runs, the run page with its spike and rollback, live points,
compare."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.browser]


def test_runs_page_lists_the_runs(server, browser) -> None:
    page = browser.new_page()
    page.goto(server + "/")
    text = page.inner_text("#runs")
    assert "spiky" in text and "lr1e-3" in text
    page.close()


def test_run_page_shows_the_spike_and_the_rollback(server, browser) -> None:
    page = browser.new_page()
    page.goto(server + "/runs/spiky")
    page.wait_for_selector("#chart-loss .main-svg")
    legend = page.inner_text("#chart-loss")
    assert "spike onset" in legend and "branch 0 (abandoned)" in legend
    assert "rollback → step" in page.inner_text("#chart-loss")
    assert "rollback" in page.inner_text("#interventions")
    assert page.locator("#heat-grad .main-svg").count() >= 1
    page.close()


def test_at_700_px_the_run_page_does_not_scroll_sideways(server, browser) -> None:
    """Issue 58 item 4: at 700 px the run page scrolled sideways (its wide tables)."""
    page = browser.new_page(viewport={"width": 700, "height": 900})
    page.goto(server + "/runs/spiky")
    page.wait_for_selector("#chart-loss .main-svg")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    page.close()


def test_zooming_a_line_chart_fetches_its_steps_again(server, browser) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    with page.expect_request(lambda r: "figures/chart-loss?buckets=" in r.url) as first:
        page.goto(server + "/runs/spiky")
    assert first.value.url.endswith("buckets=676")  # one bucket per pixel: 2 columns of 676
    page.wait_for_selector("#chart-loss .main-svg")
    with page.expect_response(lambda r: "start=20" in r.url and "end=40" in r.url) as zoom:
        page.evaluate("Plotly.relayout('chart-loss', {'xaxis.range': [20.4, 39.6]})")
    assert zoom.value.ok
    page.wait_for_function(
        "document.getElementById('chart-loss').data[0].x.filter(x => x >= 20 && x <= 40).length"
        " == 21"
    )
    rng = page.evaluate("document.getElementById('chart-loss').layout.xaxis.range")
    assert rng == [20.4, 39.6]  # the zoom survives the redraw
    page.close()


def test_a_new_point_appears_within_two_seconds(server, browser, recorded_db, tmp_path) -> None:
    from spikewatch.observatory.store.sink import DbSink

    page = browser.new_page()
    page.goto(server + "/runs/lr1e-2")
    page.wait_for_selector("#chart-loss .main-svg")
    time.sleep(1.2)  # the stream is open
    with DbSink(recorded_db, spool_dir=tmp_path / "spool") as sink:
        sink.start_run("lr1e-2")
        t0 = time.monotonic()
        sink.log_metrics("lr1e-2", 0, 61, {"train/loss": 2.5})
        sink.flush(timeout=5)
    page.wait_for_function("document.body.dataset.lastStep == '61'", timeout=2000)
    assert time.monotonic() - t0 < 2.0  # the figure: new points within 2 s
    page.close()


def test_a_finished_runs_page_settles(server, browser) -> None:
    """Issue 45, item 7: a completed run's live stream ends once nothing new came for a while,
    so the page settles (a headless browser waiting for it no longer waits for ever)."""
    page = browser.new_page()
    page.goto(server + "/runs/spiky")
    page.wait_for_selector("#chart-loss .main-svg")
    # the charts' toolbars run down their right edge, not across their titles
    assert page.evaluate("document.getElementById('chart-loss').layout.modebar.orientation") == "v"
    page.wait_for_function("document.body.dataset.streamEnded == '1'", timeout=12000)
    page.close()


def test_compare_page_renders_three_runs(server, browser) -> None:
    page = browser.new_page()
    page.goto(server + "/compare?run=spiky&run=lr1e-3&run=lr1e-2")
    page.wait_for_selector("#chart-compare .main-svg")
    # three runs, and the spiky run's spikes marked on its line
    assert page.locator("#chart-compare .scatterlayer .trace").count() == 4
    assert "spiky: spikes" in page.inner_text("#chart-compare")
    rows = page.inner_text("#compare-table")
    assert "spiky" in rows and "lr1e-3" in rows and "lr1e-2" in rows
    # the three runs differ only in their learning rate: an LR sweep, so its table and charts
    assert "LR sensitivity" in page.inner_text("#lr-table")
    for chart in ("#chart-lr-loss", "#chart-lr-peak", "#chart-logits"):
        page.wait_for_selector(f"{chart} .main-svg")
    assert page.locator("#chart-lr-loss .scatterlayer .trace").count() >= 1
    # the loss and the attention-logit panels (one per variant) each take the whole width
    whole = page.evaluate("document.querySelector('#chart-compare').parentElement.clientWidth")
    for chart in ("#chart-compare", "#chart-logits"):
        box = page.locator(chart).bounding_box()
        assert box is not None and box["width"] >= 0.95 * whole, (chart, box, whole)
    page.close()


def test_run_page_options_log_scale_ema_and_head_layer(server, browser) -> None:
    page = browser.new_page()
    page.goto(server + "/runs/spiky")
    page.wait_for_selector("#chart-loss .main-svg")
    page.check("#opt-log")
    assert page.evaluate("document.getElementById('chart-loss').layout.yaxis.type") == "log"
    page.check("#opt-ema")
    names = page.evaluate("document.getElementById('chart-loss').data.map(t => t.name)")
    assert "branch 1 (EMA)" in names and "branch 1" in names  # the raw trace stays
    page.select_option("#opt-layer", "1")
    page.wait_for_function(
        "document.getElementById('heat-heads').layout.title.text.includes('layer 1')"
    )
    page.close()


def test_runs_page_at_a_glance_and_compare_the_chosen(server, browser) -> None:
    page = browser.new_page()
    page.goto(server + "/")
    row = page.locator('tr[data-run="spiky"]')
    assert row.locator(".framework").inner_text() == "built-in"
    assert row.locator(".size").inner_text() == "2 × d64"  # tiny_cpu: 2 layers, d=64
    assert row.locator(".state").inner_text() == "completed"
    assert row.locator(".duration").inner_text().endswith("s")
    page.wait_for_selector('tr[data-run="spiky"] svg.spark polyline')
    assert row.locator("circle.spike-marker").count() >= 1  # the spike, on its sparkline
    assert page.locator('tr[data-run="lr1e-3"] circle.spike-marker').count() == 0
    assert page.locator("#compare").is_disabled()
    page.check('input.pick[value="spiky"]')
    page.check('input.pick[value="lr1e-3"]')
    page.click("#compare")
    page.wait_for_url("**/compare?run=*")
    assert sorted(page.url.split("?")[1].split("&")) == ["run=lr1e-3", "run=spiky"]
    page.wait_for_selector("#chart-loss .main-svg, .chart .main-svg")
    page.close()


def test_goodput_page_plots_the_plan_from_a_recorded_run(server, browser, recorded_db) -> None:
    """The planner with the spiky run's measured inputs: both charts drawn, the measured line
    naming the run's spike, the form keeping what was asked."""
    from spikewatch.observatory import store

    with store.session_factory(recorded_db)() as s:
        spikes = store.events(s, run_id="spiky", kinds=["spike"])
    page = browser.new_page()
    page.goto(server + "/goodput?run=spiky&step-time=6s&gpus=1024&days=2&seeds=4")
    page.wait_for_selector("#chart-goodput .main-svg")
    page.wait_for_selector("#chart-badput .main-svg")
    # two tiers' curves (a band and a line each), and one bar trace per badput bucket
    assert page.locator("#chart-goodput .scatterlayer .trace").count() == 4
    assert page.locator("#chart-badput .barlayer .trace").count() == 5
    measured = page.inner_text("#measured")
    assert "spiky" in measured and f"{len(spikes)} spikes" in measured
    assert page.locator("#plans tr").count() == 4  # a header and three plans
    assert page.input_value("input[name=gpus]") == "1024"
    before = page.inner_text("#plans")
    page.fill("input[name=gpus]", "4096")
    page.click("#goodput-form button")  # redrawn in place: no navigation, plotly.js stays
    page.wait_for_function("document.body.dataset.redrawn === '1'")
    assert "gpus=4096" in page.url and page.inner_text("#plans") != before
    assert page.locator("#chart-badput .barlayer .trace").count() == 5
    assert "spiky" in page.inner_text("#measured")
    page.fill("input[name=gpus]", "-3")
    page.click("#goodput-form button")
    page.wait_for_function("document.getElementById('goodput-error').textContent !== ''")
    assert "gpus=4096" in page.url  # a bad value changes nothing but the message
    page.close()
