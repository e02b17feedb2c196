"""The goodput planner: `spikewatch simulate` on a page. The query string takes the command's
options (`?gpus=1024&disk-interval=30min&run=RUN`); the figures come from web/charts.py, the
numbers from observatory/goodput/study.py."""

from __future__ import annotations

import functools
import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse

from observatory.goodput.cli import options, scenario_from_args
from observatory.goodput.plan import measure
from observatory.goodput.study import study
from web import charts
from web.deps import SessionDep
from web.routes.pages import templates

__all__ = ["router"]

router = APIRouter(tags=["goodput"])
FORM = (
    "gpus",
    "days",
    "step-time",
    "failure-model",
    "restart",
    "spikes-per-1k",
    "spike-back",
    "memory-interval",
    "memory-stall",
    "memory-restore",
    "disk-interval",
    "disk-stall",
    "disk-restore",
    "disk-write",
    "seeds",
)
PAGE_SEEDS = "30"  # a page answers in about a second; the command's default is 100


# The command's options a page takes: not --causes (a file on the server), --from-run (`run`
# here), --db, --optimize, --no-search or --json.
ALLOWED = {
    *FORM,
    "steps",
    "tiers",
    "seed",
    "skip",
    "failures-per-gpu-day",
    "memory-retention",
    "disk-retention",
    "memory-max-kept",
    "disk-max-kept",
    "memory-replicas",
}
LIMITS = {"gpus": 1_000_000, "days": 3_650, "steps": 100_000_000}


def _plan(session: Any, params: dict[str, str]) -> dict[str, Any]:
    params = {k.replace("_", "-"): v for k, v in params.items() if v != ""}
    run = params.pop("run", None)
    params.setdefault("seeds", PAGE_SEEDS)
    try:
        unknown = sorted(set(params) - ALLOWED)
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r} (the page takes {sorted(ALLOWED)})")
        args = options(params)
        if not 1 <= args.seeds <= 200:
            raise ValueError("seeds must be between 1 and 200 on the dashboard")
        for name, most in LIMITS.items():
            value = getattr(args, name)
            if value is not None and value > most:
                raise ValueError(f"{name} must be at most {most:,} on the dashboard")
        if args.seed < 0:
            raise ValueError("seed must be >= 0")
        measured = measure(session, run) if run else None
        sc = scenario_from_args(args, measured)
        out = _study(sc, args.seeds, args.seed)
    except ValueError as e:
        raise HTTPException(status_code=400, detail=str(e)) from None
    return {**out, "measured": measured, "options": params, "run": run}


@functools.lru_cache(maxsize=32)
def _study(sc: Any, seeds: int, seed: int) -> dict[str, Any]:
    return study(sc, seeds=seeds, seed=seed)


@router.get("/api/goodput")
def goodput(request: Request, session: SessionDep) -> dict[str, Any]:
    """Goodput against each tier's interval and badput by bucket for three plans, simulated
    (the query string takes `spikewatch simulate`'s options, plus `run` for --from-run)."""
    out = _plan(session, dict(request.query_params))
    return json.loads(json.dumps(out, default=str))


@router.get("/goodput", response_class=HTMLResponse, include_in_schema=False)
def goodput_page(request: Request, session: SessionDep) -> HTMLResponse:
    out = _plan(session, dict(request.query_params))
    figures = {
        "chart-goodput": charts.goodput_curves_figure(out),
        "chart-badput": charts.badput_figure(out),
    }
    values = {**{k: "" for k in FORM}, **out["options"]}
    context = {"out": out, "figures": figures, "form": FORM, "values": values}
    return templates.TemplateResponse(request, "goodput.html", context)
