"""The JSON API over runs: summaries, series, heatmaps, events, samples, branches, checkpoints,
logbook."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, StreamingResponse

from spikewatch.observatory import metric_names as M
from spikewatch.observatory import store
from spikewatch.observatory.reports.logbook import logbook
from spikewatch.observatory.store.models import EVENT_KINDS
from spikewatch.web.deps import SessionDep
from spikewatch.web.schemas import (
    BranchOut,
    CheckpointOut,
    EventOut,
    MatrixOut,
    RunOut,
    SampleOut,
    SeriesOut,
    many,
)

__all__ = ["router"]

router = APIRouter(prefix="/api/runs", tags=["runs"])

# the store's event kinds, as the schema's enum: an unknown kind is a 422, not an empty list
EventKind = Literal[EVENT_KINDS]  # type: ignore[valid-type]

Buckets = Annotated[int, Query(ge=1, le=20000, description="Buckets (min/max kept in each).")]
Branch = Annotated[
    int | Literal["all"] | None,
    Query(description="A branch number, 'all' (each branch's own steps) or none (the newest)."),
]
MAX_STEP = 2**31 - 1  # steps are stored as 32-bit integers
MAX_BRANCH = 32767  # branches as 16-bit ones
Step = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="First / last step to include.")]
BranchNumber = Annotated[int | None, Query(ge=0, le=MAX_BRANCH)]
# A flat metric name as the store holds them (observatory/store/names.py): no '*', no
# surrounding space
METRIC = r"^[^*\s](?:[^*]*[^*\s])?$"


@router.get("", response_model=many(RunOut))
def list_runs(
    session: SessionDep,
    status: Annotated[str | None, Query(max_length=16)] = None,
    sweep_group: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[store.RunSummary]:
    return store.list_runs(session, status=status, sweep_group=sweep_group, limit=limit)


@router.get("/{run_id}", response_model=RunOut)
def get_run(session: SessionDep, run_id: str) -> store.RunSummary:
    return store.get_run(session, run_id=run_id)


@router.get("/{run_id}/metrics", response_model=list[str])
def metric_names(session: SessionDep, run_id: str) -> list[str]:
    return store.metric_names(session, run_id=run_id)


@router.get("/{run_id}/series", response_model=many(SeriesOut))
def series(
    session: SessionDep,
    run_id: str,
    metric: Annotated[str, Query(min_length=1, max_length=200, pattern=METRIC)],
    branch: Branch = None,
    buckets: Buckets = 2000,
    start: Step = None,
    end: Step = None,
) -> list[store.SeriesData]:
    return store.series(
        session, run_id=run_id, metric=metric, branch=branch, buckets=buckets, start=start, end=end
    )


@router.get("/{run_id}/matrix", response_model=MatrixOut)
def matrix(
    session: SessionDep,
    run_id: str,
    metric: Annotated[
        str,
        Query(min_length=1, max_length=200, examples=[M.template(M.STAT_GRAD_NORM, M.ATTN_PART)]),
    ],
    layer: Annotated[
        int | None, Query(ge=0, description="Heads of this layer; none = layers.")
    ] = None,
    branch: BranchNumber = None,
    buckets: Buckets = 1000,
    start: Step = None,
    end: Step = None,
    extremes: Annotated[
        Literal["both", "max"],
        Query(description="'max' leaves the minima out (null): what a heatmap of maxima needs."),
    ] = "both",
) -> store.Matrix:
    if layer is None:
        return store.layer_matrix(
            session,
            run_id=run_id,
            metric=metric,
            branch=branch,
            buckets=buckets,
            start=start,
            end=end,
            extremes=extremes,
        )
    return store.head_matrix(
        session,
        run_id=run_id,
        metric=metric,
        layer=layer,
        branch=branch,
        buckets=buckets,
        start=start,
        end=end,
        extremes=extremes,
    )


@router.get("/{run_id}/events", response_model=many(EventOut))
def events(
    session: SessionDep,
    run_id: str,
    kind: Annotated[list[EventKind] | None, Query(description="Only these kinds.")] = None,
    branch: BranchNumber = None,
    start: Step = None,
    end: Step = None,
    limit: Annotated[int, Query(ge=1, le=100000)] = 10000,
) -> list[store.EventRow]:
    return store.events(
        session, run_id=run_id, kinds=kind, branch=branch, start=start, end=end, limit=limit
    )


@router.get("/{run_id}/branches", response_model=many(BranchOut))
def branches(session: SessionDep, run_id: str) -> list[store.BranchRow]:
    return store.branches(session, run_id=run_id)


@router.get("/{run_id}/samples", response_model=many(SampleOut))
def samples(session: SessionDep, run_id: str) -> list[store.SampleRow]:
    """The samples the run's rollbacks named as their spikes' cause (`spikewatch quarantine`)."""
    return store.samples(session, run_id=run_id)


@router.get("/{run_id}/checkpoints", response_model=many(CheckpointOut))
def checkpoints(session: SessionDep, run_id: str) -> list[store.CheckpointRow]:
    return store.checkpoints(session, run_id=run_id)


_JSON_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}


@router.get(
    "/{run_id}/logbook",
    response_class=PlainTextResponse,
    # the page is text, its errors JSON: say so (the router's error models would be text/plain)
    responses={code: {"content": _JSON_ERROR} for code in (400, 401, 403, 404)},
)
def run_logbook(session: SessionDep, run_id: str) -> str:
    return logbook(session, run_id=run_id)


@router.get(
    "/{run_id}/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "points as they come"}},
)
async def stream(
    request: Request,
    run_id: str,
    metric: Annotated[str, Query(min_length=1, max_length=200, pattern=METRIC)] = M.LOSS,
    after: Annotated[int, Query(ge=0, le=MAX_STEP)] = 0,
) -> StreamingResponse:
    """Server-Sent Events: each new point of `metric` after step `after`, about every second.
    A run that is no longer running and brought nothing new for `STREAM_END_IDLE_S` gets an
    `end` event and the stream closes (a finished run's page settles; a resumed one's reload
    streams again)."""
    sessions = request.app.state.sessions
    await run_in_threadpool(_known_run, sessions, run_id)  # 404 before the stream starts

    async def events() -> AsyncIterator[str]:
        last, idle = after, 0.0
        while not await request.is_disconnected():
            data = await run_in_threadpool(_new_points, sessions, run_id, metric, last)
            if data is not None:
                last, idle = data["steps"][-1], 0.0
                yield f"event: points\ndata: {json.dumps(data)}\n\n"
            else:
                idle += STREAM_PERIOD_S
                if idle >= STREAM_END_IDLE_S and not await run_in_threadpool(
                    _running, sessions, run_id
                ):
                    yield "event: end\ndata: {}\n\n"
                    return
                yield ": keep-alive\n\n"
            await asyncio.sleep(STREAM_PERIOD_S)

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


STREAM_PERIOD_S = 0.5
STREAM_END_IDLE_S = 5.0


def _known_run(sessions, run_id: str) -> None:
    with sessions() as session:
        store.get_run(session, run_id=run_id)


def _running(sessions, run_id: str) -> bool:
    with sessions() as session:
        try:
            return store.get_run(session, run_id=run_id).status == "running"
        except store.NotFoundError:
            return False


def _new_points(sessions, run_id: str, metric: str, after: int) -> dict | None:
    with sessions() as session:
        try:
            series = store.series(
                session, run_id=run_id, metric=metric, start=after + 1, buckets=20000
            )
        except store.NotFoundError:
            return None
    if not series:
        return None
    s = max(series, key=lambda s: s.branch)
    pts = sorted(
        {
            (b.max_step, b.max_value)
            for b in s.buckets
            if b.max_step is not None and b.max_value is not None and math.isfinite(b.max_value)
        }
    )
    if not pts:
        return None
    return {"branch": s.branch, "steps": [p[0] for p in pts], "values": [p[1] for p in pts]}
