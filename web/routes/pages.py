"""HTML pages: runs, one run, compare. Figures come from web/charts.py, data from the store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import plotly
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session

from observatory import store
from observatory.logbook import logbook
from web import charts
from web.deps import SessionDep

__all__ = ["router"]

router = APIRouter(tags=["pages"])
templates = Jinja2Templates(directory=Path(__file__).parents[1] / "templates")
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"

LINES = [
    ("chart-loss", "train/loss", "training loss"),
    ("chart-val", "val/loss", "validation loss"),
    ("chart-grad", "optim/grad_norm", "gradient norm"),
    ("chart-lr", "optim/lr", "learning rate"),
    ("chart-clip", "optim/clip_factor", "clip factor"),
]
HEATMAPS = {
    "heat-grad": ("layer/*/attn/grad_norm", "attention grad norm (layer × step)"),
    "heat-update": ("layer/*/attn/update_ratio", "attention update/param (layer × step)"),
    "heat-attn": ("layer/*/attn_max", "max attention logit (layer × step)"),
    "heat-adam-m": ("layer/*/attn/adam_m_norm", "Adam first moment norm, attention"),
    "heat-adam-v": ("layer/*/attn/adam_sqrt_v_max", "Adam max √v, attention"),
    "heat-heads": ("layer/*/head/*/attn_max", "max logit, layer {layer} (head × step)"),
}
HEAT_BUCKETS = 300


@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly_js() -> FileResponse:
    """plotly.js from the installed plotly package: the dashboard works with no internet.

    Cached by the browser for a day (the URL names no version, so not forever): later page
    loads skip the 3.5 MB download."""
    return FileResponse(
        PLOTLY_JS,
        media_type="application/javascript",
        headers={"Cache-Control": "public, max-age=86400"},
    )


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
    context = {"runs": runs, "tag": tag or "", "group": group or ""}
    return templates.TemplateResponse(request, "runs.html", context)


@router.get("/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
def run_page(request: Request, session: SessionDep, run_id: str) -> HTMLResponse:
    """Line charts come with the page; each heatmap (a heavier read) is fetched by the page
    from /api/runs/{id}/figures/{chart}, in parallel, so the lines draw first."""
    run = store.get_run(session, run_id=run_id)
    events = store.events(session, run_id=run_id)
    figures = _run_figures(session, run_id, events)
    present = set(store.metric_names(session, run_id=run_id))
    heatmaps = [chart for chart, (metric, _) in HEATMAPS.items() if metric in present]
    context = {
        "run": run,
        "figures": figures,
        "charts": list(figures) + heatmaps,
        "heatmaps": heatmaps,
        "interventions": [e for e in events if e.kind in ("rollback", "halt", "skip")],
        "checkpoints": store.checkpoints(session, run_id=run_id),
        "logbook": logbook(session, run_id=run_id),
        "layers": list(range(int(run.config.get("model", {}).get("n_layer", 0)))),
    }
    return templates.TemplateResponse(request, "run.html", context)


def _run_figures(session: Session, run_id: str, events: list[Any]) -> dict[str, Any]:
    branches = store.branches(session, run_id=run_id)
    out: dict[str, Any] = {}
    for chart_id, metric, title in LINES:
        try:
            series = store.series(session, run_id=run_id, metric=metric, branch="all")
        except store.NotFoundError:
            continue
        marks = events if metric == "train/loss" else [e for e in events if e.kind != "spike"]
        out[chart_id] = charts.series_figure(series, marks, branches, title=title)
    return out


@router.get("/api/runs/{run_id}/figures/{chart}", tags=["runs"])
def heatmap(
    session: SessionDep,
    run_id: str,
    chart: Literal[tuple(HEATMAPS)],  # type: ignore[valid-type]
    layer: Annotated[int, Query(ge=0, description="For heat-heads: whose heads.")] = 0,
) -> dict[str, Any]:
    """A run-page heatmap as a Plotly figure (layer × step, or head × step of `layer`), built
    by web/charts.py from the bucket maxima."""
    metric, title = HEATMAPS[chart]
    window = dict(run_id=run_id, metric=metric, buckets=HEAT_BUCKETS, extremes="max")
    if chart == "heat-heads":
        m = store.head_matrix(session, layer=layer, **window)
        return charts.heatmap_figure(m, title=title.format(layer=layer), row_label="head")
    return charts.heatmap_figure(store.layer_matrix(session, **window), title=title)
