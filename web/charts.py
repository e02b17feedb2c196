"""Plotly figures as plain dicts, built by pure functions of the store's rows (no server).

Series arrive downsampled by min and max per bucket; each bucket is drawn through both its
extremes in step order, so a one-step spike is always drawn at its exact height. Non-finite
values get red markers at the top of the plot. The y-axis is never clipped to hide outliers
(`autorange` on the raw extremes); log scale is an option. The live branch's history is one
line; what a rollback abandoned (a branch's steps after the history left it) is a line of its
own colour beside it; spike onsets and detections are markers; a rollback is marked where it
was decided and at the step it restored, the steps between shaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from spikewatch.observatory.reports.sweeps import SweepReport
from spikewatch.observatory.store.queries import BranchRow, EventRow, Matrix, SeriesData

__all__ = [
    "badput_figure",
    "compare_figure",
    "goodput_curves_figure",
    "heatmap_figure",
    "lr_sweep_figure",
    "series_figure",
    "small_multiples_figure",
]

LIVE = "#1f77b4"
ABANDONED = "#e6550d"  # what a rollback undid: a colour of its own, solid (the spike is there)


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _points(s: SeriesData) -> tuple[list[int], list[float], list[int]]:
    """x, y through every bucket's min and max (in step order), and the non-finite steps."""
    xs: list[int] = []
    ys: list[float] = []
    bad: list[int] = []
    for b in s.buckets:
        pts = {(b.min_step, b.min_value), (b.max_step, b.max_value)}
        for step, value in sorted((s, v) for s, v in pts if s is not None):
            if value is not None and _finite(value):
                xs.append(step)
                ys.append(value)
            elif value is not None:
                bad.append(step)
        if b.n_nan and b.nan_step is not None:
            bad.append(b.nan_step)
    return xs, ys, bad


def _lineage(branches: Sequence[BranchRow], live: int) -> dict[int, tuple[float, float]]:
    """The steps each branch holds on the live branch's history: (after, up to], from the live
    branch back through the parents it forked from (a branch forked at its restored step)."""
    by = {b.number: b for b in branches}
    owned: dict[int, tuple[float, float]] = {}
    hi, b = math.inf, live
    while True:
        row = by.get(b)
        fork = row.fork_step if row is not None and row.fork_step is not None else -math.inf
        owned[b] = (fork, hi)
        if row is None or row.parent is None or b in owned and row.parent in owned:
            return owned
        hi, b = fork, row.parent


def series_figure(
    series: Sequence[SeriesData],
    events: Sequence[EventRow] = (),
    branches: Sequence[BranchRow] = (),
    *,
    title: str = "",
    log_y: bool = False,
    x_end: int | None = None,
) -> dict[str, Any]:
    """One metric: the live branch's history as one line (the steps its ancestors hold up to
    where it forked are its own), each abandoned stretch (a branch's steps after the live
    history left it: what a rollback undid, the spike with it) as a line of its own, in a
    colour that is seen; spike markers and rollback annotations. `x_end`: the run's last step
    (a finished run), where the x-axis ends."""
    live = max((b.number for b in branches), default=max((s.branch for s in series), default=0))
    owned = _lineage(branches, live)
    traces: list[dict[str, Any]] = []
    top = max((y for s in series for y in _points(s)[1]), default=1.0)
    history: list[tuple[int, float]] = []
    for s in sorted(series, key=lambda s: s.branch):
        xs, ys, bad = _points(s)
        lo, hi = owned.get(s.branch, (math.inf, math.inf))
        history += [(x, y) for x, y in zip(xs, ys, strict=True) if lo < x <= hi]
        gone = [(x, y) for x, y in zip(xs, ys, strict=True) if not lo < x <= hi]
        if gone:
            gx, gy = [x for x, _ in gone], [y for _, y in gone]
            traces.append(
                {
                    "type": "scatter",
                    "mode": _mode(gx),
                    "x": gx,
                    "y": gy,
                    "name": f"branch {s.branch} (abandoned)",
                    "line": {"color": ABANDONED, "width": 1.5, "dash": "solid"},
                }
            )
        if bad:
            traces.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "x": bad,
                    "y": [top] * len(bad),
                    "name": f"non-finite (branch {s.branch})",
                    "marker": {"color": "red", "symbol": "x", "size": 10},
                }
            )
    if history:
        history.sort()
        hx = [x for x, _ in history]
        traces.insert(
            0,
            {
                "type": "scatter",
                "mode": _mode(hx),
                "x": hx,
                "y": [y for _, y in history],
                "name": f"branch {live}",
                "line": {"color": LIVE, "width": 1.5, "dash": "solid"},
            },
        )
    spikes = [e for e in events if e.kind == "spike"]
    if spikes:
        traces.append(
            _markers(
                "spike onset",
                [e.data.get("onset_step", e.step) for e in spikes],
                top,
                "triangle-up",
                "orange",
            )
        )
        traces.append(_markers("spike detected", [e.step for e in spikes], top, "x", "orange"))
    shapes, notes = _interventions(events)
    xaxis: dict[str, Any] = {"title": {"text": "step"}}
    ys = [y for t in traces for y in t["y"] if y is not None]
    if x_end is not None and ys:  # a finished run: the axis runs to its last step, whatever
        # the metric, by an invisible point there (autorange; a set range would undo a zoom)
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "x": [x_end],
                "y": [ys[-1]],
                "marker": {"opacity": 0},
                "hoverinfo": "skip",
                "showlegend": False,
                "name": "run end",
            }
        )
    return {
        "data": traces,
        "layout": {
            "title": {"text": title},
            "xaxis": xaxis,
            "yaxis": {"type": "log" if log_y else "linear", "autorange": True},
            "shapes": shapes,
            "annotations": notes,
            "hovermode": "x unified",
            "margin": {"t": 40, "r": 10, "b": 40, "l": 50},
            # below the axis title, which it covered when left where plotly puts it
            "legend": {"orientation": "h", "y": -0.3, "yanchor": "top"},
        },
    }


def _interventions(events: Sequence[EventRow]) -> tuple[list[dict], list[dict]]:
    """At each rollback: a dashed line where it was decided, a dotted one at the step it
    restored, the steps between (undone, then trained again) shaded, and one label (rollbacks
    decided at the same step to the same target: one label, counted); the skipped batches in
    the label. A halt: a dashed line and its label. Labels of successive interventions step
    down, so that none covers another. (shapes, annotations)"""
    shapes: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    seen: dict[tuple[int | None, Any], dict[str, Any]] = {}
    for e in events:
        if e.kind not in ("rollback", "halt"):
            continue
        to = e.data.get("to_step") if e.kind == "rollback" else None
        key = (e.step, to if e.kind == "rollback" else "halt")
        if key in seen:  # the same rollback again (or recorded twice): counted on its label
            note = seen[key]
            note["n"] += 1
            note["text"] = f"{note['n']} x {note['base']}"
            continue
        line = {"color": "crimson", "dash": "dash", "width": 1}
        shapes.append(_vline(e.step, line))
        if e.kind == "rollback":
            text = f"rollback → step {to}"
            skips = e.data.get("skip_ranges") or []
            if skips:
                text += ", skipping batches " + ", ".join(f"[{a}, {b})" for a, b in skips)
            if to is not None:
                shapes.append(_vline(to, {"color": "crimson", "dash": "dot", "width": 1}))
                shapes.append(
                    {
                        "type": "rect",
                        "xref": "x",
                        "yref": "paper",
                        "x0": to,
                        "x1": e.step,
                        "y0": 0,
                        "y1": 1,
                        "fillcolor": "rgba(220, 20, 60, 0.06)",
                        "line": {"width": 0},
                        "layer": "below",
                    }
                )
        else:
            text = "halt"
        k = len(seen)
        note = {
            "x": e.step,
            "y": 1 if k == 0 else 0.98 - 0.07 * ((k - 1) % 4),
            "xref": "x",
            "yref": "paper",
            "text": text,
            "showarrow": False,
            "yanchor": "bottom" if k == 0 else "top",
            "xanchor": "right",
            "bgcolor": "rgba(255, 255, 255, 0.8)",
            "font": {"color": "crimson", "size": 11},
        }
        notes.append(note)
        seen[key] = note
        note["n"], note["base"] = 1, text  # (taken off below: no plotly keys)
    for note in notes:
        note.pop("n", None)
        note.pop("base", None)
    return shapes, notes


def _vline(x: int | None, line: dict[str, Any]) -> dict[str, Any]:
    return {"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
            "line": line}  # fmt: skip


def _markers(
    name: str, xs: Sequence[int | None], y: float, symbol: str, color: str
) -> dict[str, Any]:
    return {
        "type": "scatter",
        "mode": "markers",
        "x": xs,
        "y": [y] * len(xs),
        "name": name,
        "marker": {"symbol": symbol, "color": color, "size": 11},
    }


def heatmap_figure(
    m: Matrix, *, title: str = "", row_label: str = "layer", events: Sequence[EventRow] = ()
) -> dict[str, Any]:
    """rows × step buckets of the bucket maxima (the extreme a spike would raise), on the live
    branch; its rollbacks marked, so that where a branch was left (the departure a rank or a
    layer shows) is seen on it."""
    shapes, notes = _interventions(events)
    z = [[v if _finite(v) else None for v in row] for row in m.max_value]
    return {
        "data": [
            {
                "type": "heatmap",
                "x": m.starts,
                "y": m.rows,
                "z": z,
                "colorscale": "Viridis",
                "hoverongaps": False,
                "colorbar": {"thickness": 14},
            }
        ],
        "layout": {
            "title": {"text": title},
            "xaxis": {"title": {"text": "step"}},
            "yaxis": {"title": {"text": row_label}, "dtick": 1},
            "shapes": shapes,
            "annotations": notes,
            "margin": {"t": 40, "r": 10, "b": 40, "l": 50},
            # the toolbar across the top: down the right edge it covered the colorbar's ticks
            "modebar": {"orientation": "h"},
        },
    }


def compare_figure(
    runs: dict[str, Sequence[SeriesData]],
    *,
    title: str = "",
    names: dict[str, str] | None = None,
    x_scale: dict[str, float] | None = None,
    x_title: str = "step",
    spikes: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """One metric for several runs overlaid (each run's newest branch), by step, or by tokens
    when `x_scale` gives each run's tokens per step; `spikes`: each run's detected spikes,
    marked on its line in its colour."""
    traces: list[dict[str, Any]] = []
    for i, (run_id, series) in enumerate(runs.items()):
        if not series:
            continue
        s = max(series, key=lambda s: s.branch)
        xs, ys, _ = _points(s)
        k = (x_scale or {}).get(run_id, 1.0)
        name = (names or {}).get(run_id, run_id)
        color = PALETTE[i % len(PALETTE)]
        traces.append(
            {
                "type": "scatter",
                "mode": _mode(xs),
                "x": [x * k for x in xs] if k != 1.0 else xs,
                "y": ys,
                "name": name,
                "line": {"color": color},
                "legendgroup": run_id,
            }
        )
        at = sorted(set((spikes or {}).get(run_id, [])))
        if at and xs:  # each at the run's own value nearest that step (the spike's height)
            near = [_nearest(xs, a) for a in at]
            traces.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "x": [a * k for a in at],
                    "y": [ys[j] for j in near],
                    "name": f"{name}: spikes",
                    "marker": {"symbol": "x", "size": 10, "color": color},
                    "legendgroup": run_id,
                }
            )
    return {
        "data": traces,
        "layout": {
            "title": {"text": title},
            "xaxis": {"title": {"text": x_title}},
            "yaxis": {"autorange": True},
            "hovermode": "x unified",
            "margin": {"t": 40, "r": 10, "b": 40, "l": 50},
        },
    }


def _nearest(xs: Sequence[int], at: int) -> int:
    """The index of the step in `xs` nearest `at`."""
    return min(range(len(xs)), key=lambda j: abs(xs[j] - at))


PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def lr_sweep_figure(report: SweepReport, *, quantity: str = "loss") -> dict[str, Any]:
    """Per variant, final validation loss (`quantity="loss"`) or peak attention logit ("peak")
    against the learning rate, log x. Diverged cells are drawn as crosses at the loss at
    initialisation (what LR sensitivity counts them as)."""
    traces: list[dict[str, Any]] = []
    for i, v in enumerate(report.variants):
        color = PALETTE[i % len(PALETTE)]
        values = v.val_by_lr if quantity == "loss" else v.peak_by_lr
        xs = [lr for lr, y in zip(report.lrs, values, strict=True) if _finite(y)]
        ys = [y for y in values if _finite(y)]
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": xs,
                "y": ys,
                "name": v.variant,
                "line": {"color": color},
                "legendgroup": v.variant,
            }
        )
        bad = [
            lr
            for lr, y, div in zip(report.lrs, values, v.diverged_by_lr, strict=True)
            if quantity == "loss" and div and not _finite(y)
        ]
        if bad and v.init_loss is not None:
            traces.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "x": bad,
                    "y": [v.init_loss] * len(bad),
                    "name": f"{v.variant} diverged",
                    "marker": {"symbol": "x", "size": 12, "color": color},
                    "legendgroup": v.variant,
                    "showlegend": False,
                }
            )
    label = "final validation loss" if quantity == "loss" else "peak attention logit"
    return {
        "data": traces,
        "layout": {
            "title": {"text": f"{label} vs learning rate"},
            "xaxis": {"title": {"text": "learning rate"}, "type": "log"},
            "yaxis": {"title": {"text": label}, "type": "log" if quantity == "peak" else "linear"},
            "margin": {"t": 40, "r": 10, "b": 40, "l": 60},
        },
    }


def small_multiples_figure(
    panels: dict[str, list[tuple[str, list[int], list[float]]]],
    *,
    title: str = "max attention logit",
    columns: int = 3,
) -> dict[str, Any]:
    """One panel per variant (shared log y), a line per run in it: `panels[variant]` holds
    (label, steps, values); a label keeps its colour in every panel."""
    names = list(panels)
    columns = max(1, min(columns, len(names)))  # one variant: the whole width, not a third
    rows = max(1, math.ceil(len(names) / columns))
    labels = sorted({lab for runs in panels.values() for lab, _, _ in runs}, key=_label_order)
    color = {lab: PALETTE[i % len(PALETTE)] for i, lab in enumerate(labels)}
    traces: list[dict[str, Any]] = []
    layout: dict[str, Any] = {
        "title": {"text": title},
        "margin": {"t": 60, "r": 10, "b": 40, "l": 50},
        "annotations": [],
        "showlegend": True,
    }
    gap = 0.06
    width = (1 - gap * (columns - 1)) / columns
    height = (1 - 0.1 * (rows - 1)) / rows
    shown: set[str] = set()
    for i, variant in enumerate(names):
        r, c = divmod(i, columns)
        ax = "" if i == 0 else str(i + 1)
        x0 = c * (width + gap)
        y1 = 1 - r * (height + 0.1)
        layout[f"xaxis{ax}"] = {"domain": [x0, x0 + width], "anchor": f"y{ax}"}
        layout[f"yaxis{ax}"] = {
            "domain": [max(0.0, y1 - height), y1],
            "anchor": f"x{ax}",
            "type": "log",
            "dtick": 1,  # a label a decade (1, 10, 100...): no 2s and 5s between, crowded
            **({"matches": "y"} if i else {}),
        }
        layout["annotations"].append(
            {
                "text": f"<b>{variant}</b>",
                "x": x0 + width / 2,
                "y": y1,
                "xref": "paper",
                "yref": "paper",
                "xanchor": "center",
                "yanchor": "bottom",
                "showarrow": False,
            }
        )
        for label, xs, ys in sorted(panels[variant], key=lambda t: _label_order(t[0])):
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "x": xs,
                    "y": ys,
                    "name": label,
                    "xaxis": f"x{ax}",
                    "yaxis": f"y{ax}",
                    "line": {"color": color[label], "width": 1.5},
                    "legendgroup": label,
                    "showlegend": label not in shown,
                }
            )
            shown.add(label)
    return {"data": traces, "layout": layout}


def _label_order(label: str) -> tuple[float, str]:
    """'lr 0.003' sorts by its number; other labels alphabetically after."""
    try:
        return (float(label.split()[-1]), label)
    except (ValueError, IndexError):
        return (math.inf, label)


def goodput_curves_figure(study: dict[str, Any]) -> dict[str, Any]:
    """Goodput against the checkpoint interval of each tier (log x), with the 5-95% band over
    seeds; Young/Daly's disk interval as a dotted line."""
    traces: list[dict[str, Any]] = []
    names = {"disk": "disk alone", "memory": "memory tier (disk as set)"}
    for i, (tier, c) in enumerate(study["curves"].items()):
        color = PALETTE[i % len(PALETTE)]
        minutes = [x / 60 for x in c["interval_s"]]
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": minutes + minutes[::-1],
                "y": c["p95"] + c["p5"][::-1],
                "fill": "toself",
                "line": {"width": 0},
                "fillcolor": color,
                "opacity": 0.15,
                "hoverinfo": "skip",
                "showlegend": False,
                "legendgroup": tier,
            }
        )
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": minutes,
                "y": c["goodput"],
                "name": names.get(tier, tier),
                "line": {"color": color},
                "legendgroup": tier,
            }
        )
    shapes = []
    daly = study["young_daly"].get("daly_interval_s")
    if daly:
        shapes.append(
            {
                "type": "line",
                "x0": daly / 60,
                "x1": daly / 60,
                "yref": "paper",
                "y0": 0,
                "y1": 1,
                "line": {"dash": "dot", "color": "#555"},
            }
        )
    return {
        "data": traces,
        "layout": {
            "title": {"text": "goodput vs checkpoint interval (dotted: Daly, disk)"},
            "xaxis": {"title": {"text": "interval (minutes)"}, "type": "log"},
            "yaxis": {"title": {"text": "goodput"}},
            "shapes": shapes,
            "margin": {"t": 40, "r": 10, "b": 40, "l": 60},
        },
    }


def _wrapped(name: str, width: int = 16) -> str:
    """A plan's name as a bar's label, in lines of about `width` characters, broken after a
    ':' or ',' too (a long one, as the search's best plan has, was cut off, and four plans'
    labels side by side overlapped at 28 characters)."""
    lines: list[str] = []
    for word in name.split(" "):
        if lines and not lines[-1].endswith((":", ",")) and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def _mode(xs: list[Any]) -> str:
    """A line, or with markers where it has a single step (a line of one point is not drawn:
    a branch with one validation point showed an empty chart)."""
    return "lines" if len(set(xs)) > 1 else "lines+markers"


def badput_figure(study: dict[str, Any]) -> dict[str, Any]:
    """Badput stacked by bucket (percent of wall time), one bar per plan."""
    plans = list(study["plans"])
    labels = [_wrapped(p) for p in plans]
    traces = [
        {
            "type": "bar",
            "name": bucket.replace("_", " "),
            "x": labels,
            "y": [100 * study["plans"][p]["badput"][bucket] for p in plans],
            "marker": {"color": PALETTE[i % len(PALETTE)]},
        }
        for i, bucket in enumerate(study["buckets"])
    ]
    return {
        "data": traces,
        "layout": {
            "title": {"text": "badput by bucket (% of wall time)"},
            "barmode": "stack",
            # the labels' lines fit below, in a smaller font
            "xaxis": {"automargin": True, "tickangle": 0, "tickfont": {"size": 10}},
            "yaxis": {"title": {"text": "% of wall time"}},
            "margin": {"t": 40, "r": 10, "b": 40, "l": 60},
            "legend": {"font": {"size": 10}},  # beside the bars, not over the labels
        },
    }
