"""HTML pages: runs, one run, compare. Figures come from web/charts.py, data from the store."""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import plotly
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.templating import Jinja2Templates

from spikewatch.observatory import metric_names as M
from spikewatch.observatory import store
from spikewatch.observatory.findings import skipped, suspect_devices
from spikewatch.observatory.reports.logbook import logbook
from spikewatch.observatory.store.queries import LOSS_METRIC
from spikewatch.web import charts
from spikewatch.web.deps import SessionDep
from spikewatch.web.routes.runs import Step

__all__ = ["router"]

router = APIRouter(tags=["pages"])
templates = Jinja2Templates(directory=Path(__file__).parents[1] / "templates")
templates.env.globals["skipped"] = skipped  # a rollback's one skip story (observatory/findings.py)
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"

LINES = {
    "chart-loss": (M.LOSS, "training loss"),
    "chart-val": (M.VAL_LOSS, "validation loss"),
    "chart-grad": (M.GRAD_NORM, "gradient norm"),
    "chart-lr": (M.LR, "learning rate"),
    "chart-clip": (M.CLIP_FACTOR, "clip factor"),
}
HEATMAPS = {
    "heat-grad": (M.template(M.STAT_GRAD_NORM, M.ATTN_PART), "attention grad norm (layer × step)"),
    "heat-update": (
        M.template(M.STAT_UPDATE_RATIO, M.ATTN_PART),
        "attention update/param (layer × step)",
    ),
    "heat-attn": (M.LAYER_ATTN_MAX, "max attention logit (layer × step)"),
    "heat-adam-m": (
        M.template(M.STAT_ADAM_M_NORM, M.ATTN_PART),
        "Adam first moment norm, attention",
    ),
    "heat-adam-v": (M.template(M.STAT_ADAM_SQRT_V_MAX, M.ATTN_PART), "Adam max √v, attention"),
    "heat-heads": (M.HEAD_ATTN_MAX, "max logit, layer {layer} (head × step)"),
    "heat-ranks": (M.RANK_LOSS, "loss of each rank's own data (rank × step)"),
}
LINE_BUCKETS = 2000
HEAT_BUCKETS = 300


def resolve(metric: str, present: set[str]) -> str | None:
    """The run's own spelling of a heatmap's template. The built-in GPT calls a block's
    attention 'attn' (`layer/*/attn/grad_norm`); other models use their module names
    (`layer/*/self_attn/grad_norm` in Hugging Face's Llama): the first such child is taken."""
    if metric in present:
        return metric
    head, sep, stat = metric.partition(f"/{M.ATTN_PART}/")
    if not sep:
        return None
    for name in sorted(present):
        parts = name.split("/")
        if len(parts) == 4 and f"{parts[0]}/{parts[1]}" == head and parts[3] == stat:
            if "attn" in parts[2] or "attention" in parts[2]:
                return name
    return None


@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly_js() -> Response:
    """plotly.js from the installed plotly package: the dashboard works with no internet.

    Prefixed with V8's compile hint `//# allFunctionsCalledOnLoad` (Chromium 136+; other
    browsers read a comment): plotly.js runs much of its 4.8 MB while it loads, and the hint
    has Chromium compile it on a background thread as it streams in, instead of lazily on the
    main thread. Cached by the browser for a day (the URL names no version, so not forever)."""
    return Response(
        _plotly_js(),
        media_type="application/javascript",
        headers={"Cache-Control": "public, max-age=86400"},
    )


@functools.cache
def _plotly_js() -> bytes:
    return b"//# allFunctionsCalledOnLoad\n" + PLOTLY_JS.read_bytes()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def runs_page(
    request: Request,
    session: SessionDep,
    tag: Annotated[str | None, Query(max_length=64)] = None,
    group: Annotated[str | None, Query(max_length=128)] = None,
) -> HTMLResponse:
    runs = store.list_runs(session, sweep_group=group or None)
    if tag:
        runs = [r for r in runs if tag in r.tags]
    now = datetime.now(UTC)
    rows = [(r, glance(r, now)) for r in runs]
    context = {"rows": rows, "tag": tag or "", "group": group or "", "loss": M.LOSS}
    return templates.TemplateResponse(request, "runs.html", context)


def glance(run: store.RunSummary, now: datetime) -> dict[str, str]:
    """What the runs page shows of a run beside the store's columns: where it came from, the
    model's size, live or not, and how long it ran."""
    cfg = run.config or {}
    framework = cfg.get("framework") or ("followed log" if "source" in cfg else "built-in")
    described = cfg.get("model")
    model: dict[str, Any] = described if isinstance(described, dict) else {}
    params = model.get("parameters")
    if isinstance(params, (int, float)) and params > 0:
        size = f"{params / 1e6:,.1f}M" if params >= 1e5 else f"{params / 1e3:,.0f}k"
    elif model.get("n_layer") and model.get("d_model"):
        size = f"{model['n_layer']} × d{model['d_model']}"
    else:
        size = ""
    updated, created = _utc(run.updated_at), _utc(run.created_at)
    end = _utc(run.ended_at) if run.ended_at else updated
    state = store.run_state(run, now)  # live, stalled, gone, silent, or how it ended
    return {
        "framework": str(framework),
        "size": size,
        "state": state,
        "duration": _duration((end - created).total_seconds()),
    }


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@router.get("/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
def run_page(request: Request, session: SessionDep, run_id: str) -> HTMLResponse:
    """The page comes without chart data, so it arrives at once and plotly.js starts loading;
    its first script requests every chart from /api/runs/{id}/figures/{chart} in parallel, and
    the server builds them while the browser is still evaluating plotly.js."""
    run = store.get_run(session, run_id=run_id)
    events = store.events(session, run_id=run_id)
    present = set(store.metric_names(session, run_id=run_id))
    lines = [chart for chart, (metric, _) in LINES.items() if metric in present]
    heatmaps = [chart for chart, (metric, _) in HEATMAPS.items() if resolve(metric, present)]
    context = {
        "run": run,
        "charts": lines + heatmaps,
        "lines": lines,
        "interventions": [e for e in events if e.kind in ("rollback", "halt", "skip")],
        "checkpoints": store.checkpoints(session, run_id=run_id),
        "samples": store.samples(session, run_id=run_id),
        "suspects": suspect_devices(e.data for e in events if e.kind == "rollback"),
        "logbook": logbook(session, run_id=run_id),
        "layers": list(range(int(run.config.get("model", {}).get("n_layer", 0)))),
        "memory_interval": _memory_interval(session, run_id, present),
    }
    return templates.TemplateResponse(request, "run.html", context)


def _memory_interval(session: SessionDep, run_id: str, present: set[str]) -> int | None:
    """The host-memory tier's interval as last measured ('auto', CheckFreq), if recorded."""
    if M.CKPT_MEMORY_INTERVAL not in present:
        return None
    data = store.series(session, run_id=run_id, metric=M.CKPT_MEMORY_INTERVAL, buckets=1000)
    last = [b for d in data for b in d.buckets if b.n and b.max_value is not None]
    return int(max(last, key=lambda b: b.end).max_value) if last else None  # type: ignore[arg-type]


@router.get("/api/runs/{run_id}/figures/{chart}", tags=["runs"])
def figure(
    session: SessionDep,
    run_id: str,
    chart: Literal[tuple(LINES) + tuple(HEATMAPS)],  # type: ignore[valid-type]
    buckets: Annotated[
        int | None,
        Query(ge=1, le=20000, description="Default: 2000 (lines), 300 (heatmaps)."),
    ] = None,
    start: Step = None,
    end: Step = None,
    layer: Annotated[int, Query(ge=0, description="For heat-heads: whose heads.")] = 0,
) -> dict[str, Any]:
    """A run-page chart as a Plotly figure, built by web/charts.py: a line chart of every
    branch with its spikes and interventions, or a heatmap of bucket maxima (layer x step, or
    head x step of `layer`). `start`/`end` narrow the steps (the page asks again on zoom)."""
    if chart in LINES:
        metric, title = LINES[chart]
        series = store.series(
            session,
            run_id=run_id,
            metric=metric,
            branch="all",
            buckets=buckets or LINE_BUCKETS,
            start=start,
            end=end,
        )
        events = store.events(session, run_id=run_id)
        if metric != LOSS_METRIC:
            events = [e for e in events if e.kind != "spike"]
        branches = store.branches(session, run_id=run_id)
        run = store.get_run(session, run_id=run_id)
        whole = start is None and end is None and run.status != "running"
        x_end = run.last_step if whole else None  # a finished run's axis reaches its end
        return charts.series_figure(series, events, branches, title=title, x_end=x_end)
    events = [e for e in store.events(session, run_id=run_id) if e.kind in ("rollback", "halt")]
    metric, title = HEATMAPS[chart]
    metric = resolve(metric, set(store.metric_names(session, run_id=run_id))) or metric
    n = buckets or HEAT_BUCKETS
    if chart == "heat-heads":
        m = store.head_matrix(
            session,
            run_id=run_id,
            metric=metric,
            layer=layer,
            buckets=n,
            start=start,
            end=end,
            extremes="max",
        )
        return charts.heatmap_figure(
            m, title=title.format(layer=layer), row_label="head", events=events
        )
    m = store.layer_matrix(
        session, run_id=run_id, metric=metric, buckets=n, start=start, end=end, extremes="max"
    )
    return charts.heatmap_figure(
        m, title=title, row_label="rank" if chart == "heat-ranks" else "layer", events=events
    )
