"""The figure builders in web/charts.py, as pure functions of store rows (no server, no DB)."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from spikewatch.observatory.reports.sweeps import Cell, SweepReport, VariantSummary
from spikewatch.observatory.store.queries import BranchRow, Bucket, EventRow, Matrix, SeriesData
from spikewatch.web import charts

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _bucket(step: int, lo: float, hi: float, lo_step: int | None = None, nan: int = 0) -> Bucket:
    return Bucket(step, step, 1, nan, step if nan else None, lo, lo_step or step, hi, step)


def _series(branch: int, values: dict[int, float]) -> SeriesData:
    buckets = [
        _bucket(s, v, v) if not math.isnan(v) else Bucket(s, s, 1, 1, s, None, None, None, None)
        for s, v in sorted(values.items())
    ]
    lo, hi = min(values), max(values)
    return SeriesData("r", "train/loss", branch, [(branch, lo, hi)], 1, buckets)


def test_series_draw_the_spike_the_nan_and_the_abandoned_branch() -> None:
    abandoned = _series(0, {1: 3.0, 2: 2.9, 3: 40.0, 4: math.nan})
    live = _series(1, {3: 2.8, 4: 2.7})
    events = [
        EventRow("u1", 0, 3, "spike", "trainer", "z=9", {"onset_step": 3}, NOW),
        EventRow("u2", 0, 4, "rollback", "trainer", "", {"to_step": 2}, NOW),
    ]
    branches = [BranchRow(0, None, None, None, NOW), BranchRow(1, 0, 2, "rollback", NOW)]
    fig = charts.series_figure([abandoned, live], events, branches, title="loss")
    lines = {t["name"]: t for t in fig["data"] if t["mode"].startswith("lines")}
    # the live history: branch 0's steps up to the fork (2), then branch 1's own
    assert lines["branch 1"]["x"] == [1, 2, 3, 4] and lines["branch 1"]["y"] == [3.0, 2.9, 2.8, 2.7]
    gone = lines["branch 0 (abandoned)"]  # only what the rollback undid, in a colour of its own
    assert gone["x"] == [3] and gone["y"] == [40.0]  # the one-step spike, drawn at its height
    assert (
        gone["line"]["dash"] == "solid"
        and gone["line"]["color"] != lines["branch 1"]["line"]["color"]
    )
    nan = next(t for t in fig["data"] if t["name"].startswith("non-finite"))
    assert nan["x"] == [4] and nan["y"] == [40.0]  # at the top, where it is seen
    names = {t["name"] for t in fig["data"]}
    assert {"spike onset", "spike detected"} <= names
    shapes = fig["layout"]["shapes"]
    assert [(x["type"], x["x0"]) for x in shapes] == [("line", 4), ("line", 2), ("rect", 2)]
    assert shapes[2]["x1"] == 4  # the steps undone, shaded
    assert fig["layout"]["annotations"][0]["text"] == "rollback → step 2"
    assert fig["layout"]["yaxis"] == {"type": "linear", "autorange": True}  # nothing clipped
    assert charts.series_figure([live], log_y=True)["layout"]["yaxis"]["type"] == "log"


def test_a_branch_of_one_point_is_drawn_with_a_marker() -> None:
    """Issue 45, item 7: a validation loss with one point on a branch (a line of one point is
    drawn as nothing) showed an empty chart."""
    one = _series(1, {50: 2.1})
    many = _series(0, {10: 2.5, 20: 2.3})
    fig = charts.series_figure([many, one], title="val")
    modes = {t["name"]: t["mode"] for t in fig["data"]}
    assert modes == {"branch 0 (abandoned)": "lines", "branch 1": "lines+markers"}  # no branches
    # told its branches, branch 1's history holds branch 0's steps up to its fork
    forked = [BranchRow(0, None, None, None, NOW), BranchRow(1, 0, 20, "rollback", NOW)]
    fig = charts.series_figure([many, one], branches=forked, title="val")
    assert {t["name"]: t["x"] for t in fig["data"]} == {"branch 1": [10, 20, 50]}
    cmp = charts.compare_figure({"a": [one], "b": [many]}, title="val")
    assert [t["mode"] for t in cmp["data"]] == ["lines+markers", "lines"]


def test_a_finished_runs_axis_runs_to_its_end_and_heatmaps_mark_the_rollback() -> None:
    """Issue 45, item 7: the validation chart's axis stopped at its last point, before the
    run's end; the heatmaps drew the live branch with nothing to say where it began."""
    val = _series(0, {50: 2.4, 100: 2.2})
    fig = charts.series_figure([val], x_end=130)
    end = [t for t in fig["data"] if t["name"] == "run end"]
    assert len(end) == 1 and end[0]["x"] == [130] and end[0]["marker"]["opacity"] == 0
    assert "range" not in fig["layout"]["xaxis"]  # autorange reaches it; a zoom is kept
    assert not [t for t in charts.series_figure([val])["data"] if t["name"] == "run end"]
    legend = fig["layout"]["legend"]  # below the axis title, which it covered (screenshot)
    assert legend["orientation"] == "h" and legend["y"] <= -0.3 and legend["yanchor"] == "top"
    rollback = EventRow("u2", 0, 84, "rollback", "trainer", "", {"to_step": 70}, NOW)
    grid = [[1.0, 2.0], [1.0, 9.0]]
    m = Matrix("r", "rank/*/loss", 1, [0, 1], [0, 64], 64, grid, [[0, 64]] * 2, grid,
               [[1, 65]] * 2, [[64, 64]] * 2, [[0, 0]] * 2)  # fmt: skip
    heat = charts.heatmap_figure(m, row_label="rank", events=[rollback])
    assert heat["layout"]["shapes"][0]["x0"] == 84 and heat["layout"]["shapes"][1]["x0"] == 70
    assert heat["layout"]["annotations"][0]["text"] == "rollback → step 70"
    # the toolbar across the top: down the right edge it covered the colorbar's ticks
    assert heat["layout"]["modebar"] == {"orientation": "h"} and "modebar" not in fig["layout"]


def test_two_rollbacks_to_one_step_get_one_label_and_labels_step_down() -> None:
    """Issue 58 item 4: two rollbacks to the same step read "rollbackrollbackstep 125step
    125"; and labels of nearby rollbacks covered each other."""
    same = [
        EventRow(f"u{i}", 0, 150, "rollback", "trainer", "", {"to_step": 125}, NOW)
        for i in range(2)
    ]
    other = EventRow("u9", 1, 160, "rollback", "trainer", "", {"to_step": 125,
                     "skip_ranges": [[148, 162]]}, NOW)  # fmt: skip
    notes = charts.series_figure([_series(0, {1: 1.0})], [*same, other])["layout"]["annotations"]
    assert [n["text"] for n in notes] == [
        "2 x rollback → step 125",
        "rollback → step 125, skipping batches [148, 162)",
    ]
    assert notes[0]["y"] != notes[1]["y"]  # one under the other


def test_a_bucket_is_drawn_through_both_extremes_in_step_order() -> None:
    b = Bucket(0, 15, 16, 0, None, 1.0, 9, 7.0, 4)
    s = SeriesData("r", "m", 0, [(0, 0, 15)], 16, [b])
    line = charts.series_figure([s])["data"][0]
    assert line["x"] == [4, 9] and line["y"] == [7.0, 1.0]


def test_heatmap_shows_bucket_maxima_and_blanks_non_finite() -> None:
    m = Matrix(
        "r", "layer/*/attn_max", 0, [0, 1], [0, 16], 16,
        [[1.0, 2.0], [3.0, None]], [[0, 16], [0, None]],
        [[1.5, math.inf], [3.5, None]], [[1, 17], [2, None]],
        [[16, 16], [16, 0]], [[0, 0], [0, 0]],
    )  # fmt: skip
    fig = charts.heatmap_figure(m, title="t", row_label="head")
    heat = fig["data"][0]
    assert heat["z"] == [[1.5, None], [3.5, None]] and heat["x"] == [0, 16] and heat["y"] == [0, 1]
    assert fig["layout"]["yaxis"]["title"]["text"] == "head"


def test_compare_aligns_by_tokens_and_names_runs() -> None:
    a, b = _series(0, {1: 3.0, 2: 2.0}), _series(0, {1: 3.5, 2: 2.5})
    fig = charts.compare_figure(
        {"a": [a], "b": [b]},
        names={"a": "baseline lr 0.01"},
        x_scale={"a": 2048.0, "b": 1024.0},
        x_title="tokens",
    )
    assert [t["name"] for t in fig["data"]] == ["baseline lr 0.01", "b"]
    assert fig["data"][0]["x"] == [2048.0, 4096.0] and fig["data"][1]["x"] == [1024.0, 2048.0]
    assert fig["layout"]["xaxis"]["title"]["text"] == "tokens"
    assert charts.compare_figure({"a": [a], "empty": []})["data"][0]["x"] == [1, 2]


def _report() -> SweepReport:
    lrs = [1e-3, 1e-2, 1e-1]
    base = VariantSummary(
        "baseline", [3.0, 2.5, math.inf], [8.0, 60.0, 900.0], [False, False, True],
        5.5, 2.5, (3.0 + 2.5 + 5.5) / 3 - 2.5, 1, 0, 3, 3,
    )  # fmt: skip
    qk = VariantSummary(
        "qk_norm", [2.9, 2.4, 2.6], [5.0, 6.0, 7.0], [False] * 3, 5.5, 2.4, 0.23, 0, 0, 3, 3
    )
    return SweepReport("g", "h", NOW, {}, lrs, [base, qk], [Cell("baseline", 1e-3, 0)])


def test_lr_sweep_figure_marks_diverged_runs_at_the_initial_loss() -> None:
    fig = charts.lr_sweep_figure(_report(), quantity="loss")
    base, crosses, qk = fig["data"]
    assert base["x"] == [1e-3, 1e-2] and base["y"] == [3.0, 2.5]  # the diverged point left out
    assert crosses["x"] == [1e-1] and crosses["y"] == [5.5] and crosses["marker"]["symbol"] == "x"
    assert qk["y"] == [2.9, 2.4, 2.6]
    assert fig["layout"]["xaxis"]["type"] == "log" and fig["layout"]["yaxis"]["type"] == "linear"
    peak = charts.lr_sweep_figure(_report(), quantity="peak")
    assert peak["data"][0]["y"] == [8.0, 60.0, 900.0] and len(peak["data"]) == 2
    assert peak["layout"]["yaxis"]["type"] == "log"


def test_small_multiples_one_panel_per_variant_same_colour_per_lr() -> None:
    panels = {
        "baseline": [("lr 0.1", [1, 2], [5.0, 500.0]), ("lr 0.01", [1, 2], [5.0, 9.0])],
        "qk_norm": [("lr 0.01", [1, 2], [4.0, 5.0]), ("lr 0.1", [1, 2], [4.0, 6.0])],
        "muonclip": [("lr 0.1", [1, 2], [5.0, 100.0])],
    }
    fig = charts.small_multiples_figure(panels, columns=2)
    lay = fig["layout"]
    assert {"xaxis", "xaxis2", "xaxis3", "yaxis", "yaxis2", "yaxis3"} <= set(lay)
    assert all(lay[k]["type"] == "log" for k in ("yaxis", "yaxis2", "yaxis3"))
    assert lay["yaxis2"]["matches"] == "y"  # one scale: panels compare by eye
    assert [a["text"] for a in lay["annotations"]] == [
        "<b>baseline</b>",
        "<b>qk_norm</b>",
        "<b>muonclip</b>",
    ]
    colour = {}
    for t in fig["data"]:
        assert colour.setdefault(t["name"], t["line"]["color"]) == t["line"]["color"]
    assert [t["name"] for t in fig["data"][:2]] == ["lr 0.01", "lr 0.1"]  # by LR, not input order
    assert sum(t["showlegend"] for t in fig["data"]) == 2  # one legend entry per LR
    assert {t["yaxis"] for t in fig["data"]} == {"y", "y2", "y3"}


def test_compare_marks_each_runs_spikes_in_its_colour_and_one_panel_takes_the_width() -> None:
    """Issue 58 item 4: the compare page drew the loss with no spike marker, and squeezed the
    attention-logit panel of one variant into a third of its width."""
    a, b = _series(0, {1: 2.0, 2: 9.0, 3: 2.1}), _series(0, {1: 2.0, 2: 2.0, 3: 1.9})
    fig = charts.compare_figure({"a": [a], "b": [b]}, spikes={"a": [2], "b": []})
    marks = [t for t in fig["data"] if t["mode"] == "markers"]
    assert [(t["name"], t["x"], t["y"]) for t in marks] == [("a: spikes", [2], [9.0])]
    assert marks[0]["marker"]["color"] == fig["data"][0]["line"]["color"]  # the run's colour
    one = charts.small_multiples_figure({"v": [("lr 0.01", [1, 2], [3.0, 4.0])]})
    assert one["layout"]["xaxis"]["domain"] == [0, 1]
