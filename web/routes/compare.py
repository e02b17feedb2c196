"""Comparing runs: the compare page and the sweeps API (a sweep group, or any chosen runs).

The numbers come from observatory/reports/sweeps.py (the same report `spikewatch sweep-report`
prints), the figures from web/charts.py.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from sqlalchemy.orm import Session

from spikewatch.observatory import metric_names as M
from spikewatch.observatory import store
from spikewatch.observatory.reports.census import GRAD_SPIKE_FACTOR, GRAD_SPIKE_WINDOW
from spikewatch.observatory.reports.sweeps import (
    SweepReport,
    format_rate,
    list_sweeps,
    report_for_runs,
    sweep_report,
)
from spikewatch.observatory.store import across_runs as across
from spikewatch.web import charts
from spikewatch.web.deps import SessionDep
from spikewatch.web.routes.pages import templates
from spikewatch.web.schemas import SweepOut, SweepReportOut, many

__all__ = ["router"]

router = APIRouter(tags=["compare"])
ATTN_MAX = M.LAYER_ATTN_MAX


@router.get("/api/sweeps", response_model=many(SweepOut))
def sweeps(session: SessionDep) -> list[Any]:
    """Registered sweeps, newest first, with their grid and pre-registered hypothesis."""
    return list_sweeps(session)


@router.get("/api/sweeps/{group}", response_model=SweepReportOut)
def sweep(session: SessionDep, group: str) -> SweepReport:
    """Per cell and per variant: final validation loss, peak attention logit, LR sensitivity."""
    return sweep_report(session, group)


@router.get("/compare", response_class=HTMLResponse, include_in_schema=False)
def compare_page(
    request: Request,
    session: SessionDep,
    run: Annotated[list[str] | None, Query(max_length=200)] = None,
    group: Annotated[str | None, Query(max_length=200)] = None,
    metric: Annotated[str, Query(min_length=1, max_length=200)] = M.LOSS,
    align: Literal["step", "tokens"] = "step",
) -> HTMLResponse:
    all_runs = store.list_runs(session)
    if group:
        report = sweep_report(session, group)
    else:
        chosen = run or [r.run_id for r in all_runs[:3]]
        report = report_for_runs(session, chosen)
    ran = [c for c in report.cells if c.run_id is not None]
    seeds = len({c.seed for c in ran}) > 1
    runs = {r.run_id: r for r in all_runs}
    if group:  # a group's runs by their cell (its newest run of each)
        names = {
            c.run_id: f"{c.variant} lr {c.lr:g}" + (f" seed {c.seed}" if seeds else "")
            for c in ran
            if c.run_id
        }
    else:  # chosen runs, every one by its id: a fault run beside its clean twin (the same
        # cell, which the report keeps once) is what a user compares
        names = {r: r for r in dict.fromkeys(chosen) if r in runs}
    rows = across.runs_by_key(session, list(names))
    figures: dict[str, Any] = {
        "chart-compare": charts.compare_figure(
            _series(session, rows, metric),
            title=metric,
            names=names,
            x_scale=_tokens_per_step(session, list(names), runs) if align == "tokens" else None,
            x_title="tokens" if align == "tokens" else "step",
            spikes=_spikes(session, rows),
        )
    }
    panels = _max_logit_panels(session, report, rows)
    if panels:
        figures["chart-logits"] = charts.small_multiples_figure(
            panels, title="max attention logit over layers (per variant)"
        )
    if report.is_lr_sweep:
        figures["chart-lr-loss"] = charts.lr_sweep_figure(report, quantity="loss")
        figures["chart-lr-peak"] = charts.lr_sweep_figure(report, quantity="peak")
    groups = sorted(
        {s.name for s in list_sweeps(session)} | {r.sweep_group for r in all_runs if r.sweep_group}
    )
    context = {
        "all_runs": all_runs,
        "groups": groups,
        "group": group or "",
        "chosen": list(names),
        "report": report,
        "figures": figures,
        "metric": metric,
        "align": align,
        "fmt": _fmt,
        "rate": format_rate,
        "grad_factor": GRAD_SPIKE_FACTOR,
        "grad_window": GRAD_SPIKE_WINDOW,
    }
    return templates.TemplateResponse(request, "compare.html", context)


def _series(session: Session, rows: dict[str, Any], metric: str) -> dict[str, Any]:
    """Every chosen run's newest history of `metric`, read for all runs at once."""
    try:
        return across.histories(session, rows, metric, buckets=1000)
    except ValueError:  # a name the store cannot hold: no run has it
        return {run_id: [] for run_id in rows}


def _spikes(session: Session, rows: dict[str, Any]) -> dict[str, list[int]]:
    """Each run's detected spikes (their steps), for markers on the compared metric (one
    statement for all the runs)."""
    steps = across.event_steps(session, [row.id for row in rows.values()], "spike")
    return {key: steps[row.id] for key, row in rows.items()}


def _tokens_per_step(
    session: Session, run_ids: list[str], runs: dict[str, store.RunSummary]
) -> dict[str, float]:
    out = {}
    for run_id in run_ids:
        r = runs.get(run_id) or store.get_run(session, run_id=run_id)
        data = r.config.get("data", {})
        out[run_id] = float(data.get("batch_size", 1) * data.get("seq_len", 1))
    return out


def _max_logit_panels(
    session: Session, report: SweepReport, rows: dict[str, Any]
) -> dict[str, list[tuple[str, list[int], list[float]]]]:
    """Per variant, each run's max attention logit over layers per step bucket (the layer
    maxima of every run read at once)."""
    panels: dict[str, list[tuple[str, list[int], list[float]]]] = {}
    matrices = across.layer_matrices(session, rows, ATTN_MAX, buckets=200)
    for c in report.cells:
        m = matrices.get(c.run_id) if c.run_id is not None else None
        if m is None:
            continue
        xs: list[int] = []
        ys: list[float] = []
        for k, start in enumerate(m.starts):
            col = [v for row in m.max_value if (v := row[k]) is not None and math.isfinite(v)]
            first = m.max_step[0][k]
            if col:
                xs.append(first if m.bucket_width == 1 and first is not None else start)
                ys.append(max(col))
        label = f"lr {c.lr:g}" + (f" s{c.seed}" if c.seed else "")
        panels.setdefault(c.variant, []).append((label, xs, ys))
    return panels


def _fmt(v: float | None, spec: str = ".3f") -> str:
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return "diverged" if v > 0 else "nan"
    return format(v, spec)
