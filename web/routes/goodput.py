"""The goodput planner: `spikewatch simulate` on a page. The query string takes the command's
options (`?gpus=1024&disk-interval=30min&run=RUN`); the figures come from web/charts.py, the
numbers from observatory/goodput/study.py."""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse

from spikewatch.observatory.goodput.cli import options, scenario_from_args
from spikewatch.observatory.goodput.plan import measure, optimize
from spikewatch.observatory.goodput.study import PlanCache, study
from spikewatch.web import charts
from spikewatch.web.deps import SessionDep
from spikewatch.web.routes.pages import templates

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
    "sdc-rate",
    "straggler",
    "memory-budget",
    "seeds",
)
PAGE_SEEDS = "30"  # a page answers in about a second; the command's default is 100


# The command's options a page takes: not --causes (a file on the server), --from-run (`run`
# here), --db, --no-search or --json. `optimize` adds the best plan of a smaller search.
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
    "retention",
    "optimize",
    "recovery-failures",
    "maintenance",
    "maintenance-window",
    "sdc-detect",
    "spike-repeat",
}
OPTIMIZE = {"seeds": 10, "points": 5}  # the page's search: ~100 plans in about a second
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
        if args.memory_budget is not None and args.memory_budget < 1:
            raise ValueError("memory-budget must be >= 1 snapshot")
        out = _study(sc, args.seeds, args.seed)
        if args.optimize:
            out = _optimized(out, sc, args.seed, args.memory_budget)
    except ValueError as e:
        raise HTTPException(status_code=400, detail=str(e)) from None
    return {**out, "measured": measured, "options": params, "run": run}


_PLANS = PlanCache()  # the plans a control change leaves as they were are not simulated again


@functools.lru_cache(maxsize=32)
def _study(sc: Any, seeds: int, seed: int) -> dict[str, Any]:
    return study(sc, seeds=seeds, seed=seed, cache=_PLANS)


@functools.lru_cache(maxsize=32)
def _search(sc: Any, seed: int, budget: int | None) -> dict[str, Any]:
    found = optimize(sc, seed=seed, budget=budget, **OPTIMIZE)
    found.pop("scenario")
    return found


def _optimized(out: dict[str, Any], sc: Any, seed: int, budget: int | None) -> dict[str, Any]:
    """The study with `simulate --optimize`'s best plan (a smaller search) as one more plan."""
    found = _search(sc, seed, budget)
    b = found["best"]
    memory = (
        "no memory tier"
        if b["memory_interval"] is None
        else f"memory every {b['memory_interval']} steps ({b['memory_retention']})"
    )
    name = (
        f"best of {found['configurations']} plans ({found['seeds']} seeds): {memory}, "
        f"disk every {b['disk_interval']}"
    )
    # the page's search is smaller than `spikewatch simulate --optimize`'s (said on the page)
    cli = inspect.signature(optimize).parameters
    found = {
        **found,
        "points": OPTIMIZE["points"],
        "cli_points": cli["points"].default,
        "cli_seeds": cli["seeds"].default,
    }
    return {**out, "plans": {**out["plans"], name: b}, "optimize": found}


@router.get("/api/goodput")
def goodput(request: Request, session: SessionDep) -> dict[str, Any]:
    """Goodput against each tier's interval and badput by bucket for three plans, simulated
    (the query string takes `spikewatch simulate`'s options, plus `run` for --from-run)."""
    out = _plan(session, dict(request.query_params))
    return json.loads(json.dumps(out, default=str))


def _figures(out: dict[str, Any]) -> dict[str, Any]:
    return {
        "chart-goodput": charts.goodput_curves_figure(out),
        "chart-badput": charts.badput_figure(out),
    }


@router.get("/goodput/view", include_in_schema=False)
def goodput_view(request: Request, session: SessionDep) -> dict[str, Any]:
    """What the page redraws in place when a control changes: its figures and plans table."""
    out = _plan(session, dict(request.query_params))
    table = templates.get_template("goodput_plans.html").render(out=out)
    return json.loads(json.dumps({"figures": _figures(out), "table": table}, default=str))


@router.get("/goodput", response_class=HTMLResponse, include_in_schema=False)
def goodput_page(request: Request, session: SessionDep) -> HTMLResponse:
    out = _plan(session, dict(request.query_params))
    figures = _figures(out)
    values = {**{k: "" for k in FORM}, **out["options"]}
    context = {"out": out, "figures": figures, "form": FORM, "values": values}
    return templates.TemplateResponse(request, "goodput.html", context)
