"""Control endpoints, behind a bearer token (`SPIKEWATCH_TOKEN`): without one configured they
are off (403), without or with a wrong token they refuse (401 / 403) and do nothing.

Annotations, and requests for a running training: roll back to a retained checkpoint, or stop.
A request is stored as an event of kind "request"; the trainer's recorder polls for them in a
thread and carries them out between steps (observatory/control.py).
"""

from __future__ import annotations

import hmac
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from pydantic import BaseModel, Field

from spikewatch.observatory import store
from spikewatch.observatory.store.ingest import Writer
from spikewatch.observatory.store.records import Record, RecordError, event_record, new_uid
from spikewatch.web.deps import SessionDep
from spikewatch.web.schemas import errors

__all__ = ["router"]


def require_token(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    expected = request.app.state.settings.token
    if expected is None:
        raise HTTPException(403, "control is off: set SPIKEWATCH_TOKEN to enable it")
    if authorization is None or not authorization.startswith("Bearer "):
        raise HTTPException(401, "a bearer token is required", {"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(authorization.removeprefix("Bearer "), expected):
        raise HTTPException(403, "wrong token")


READ_COOKIE = "spikewatch_token"


def require_read_token(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> None:
    """Reading is open unless `SPIKEWATCH_READ_TOKEN` is set. Then a bearer header, the
    `spikewatch_token` cookie, or `?token=` (which sets the cookie, for browsers) must carry it
    (or the control token)."""
    settings = request.app.state.settings
    if settings.read_token is None:
        return
    given = [
        (authorization or "").removeprefix("Bearer "),
        request.cookies.get(READ_COOKIE, ""),
        request.query_params.get("token", ""),
    ]
    allowed = [t for t in (settings.read_token, settings.token) if t]
    if not any(g and hmac.compare_digest(g, t) for g in given for t in allowed):
        raise HTTPException(
            401,
            "a token is required to read (bearer header, or ?token=)",
            {"WWW-Authenticate": "Bearer"},
        )


router = APIRouter(
    prefix="/api/runs",
    tags=["control"],
    dependencies=[Depends(require_token)],
    responses=errors(400, 401, 403, 404, 409),
)


class AnnotationIn(BaseModel):
    text: str = Field(min_length=1, max_length=2000, description="What happened, in words.")
    step: int | None = Field(None, ge=0, description="The step it refers to; none = the run.")
    branch: int = Field(0, ge=0, description="The branch of that step.")


class AnnotationOut(BaseModel):
    uid: str


@router.post("/{run_id}/annotations", response_model=AnnotationOut, status_code=201)
def annotate(request: Request, session: SessionDep, run_id: str, body: AnnotationIn) -> dict:
    store.get_run(session, run_id=run_id)  # 404 for an unknown run
    try:
        rec = event_record(
            run_id,
            "annotation",
            uid=new_uid(),  # a person may write the same note twice: two annotations
            branch=body.branch,
            step=body.step,
            source="dashboard",
            message=body.text,
            data={},
        )
    except RecordError as e:
        raise HTTPException(400, str(e)) from None
    _write(request, rec)
    return {"uid": rec.data["uid"]}


class RequestIn(BaseModel):
    action: Literal["rollback", "stop"] = Field(description="What the trainer should do.")
    to_step: int | None = Field(
        None, ge=0, description="rollback: the newest retained checkpoint at or before this step."
    )


@router.post("/{run_id}/requests", response_model=AnnotationOut, status_code=202)
def request_action(request: Request, session: SessionDep, run_id: str, body: RequestIn) -> dict:
    run = store.get_run(session, run_id=run_id)
    if run.status != "running":
        raise HTTPException(409, f"run {run_id!r} is {run.status}: nothing to control")
    data = {"action": body.action, "to_step": body.to_step}
    rec = event_record(
        run_id,
        "request",
        uid=new_uid(),  # every request is answered, even one repeated word for word
        branch=0,
        step=None,
        source="dashboard",
        message=f"{body.action} requested",
        data=data,
    )
    _write(request, rec)
    return {"uid": rec.data["uid"]}


def _write(request: Request, rec: Record) -> None:
    """One record through the app's one Writer. Sync routes run in a thread pool and a Writer
    (its id caches) is not thread-safe: one write at a time."""
    with request.app.state.write_lock:
        request.app.state.writer.write([rec])


def make_writer(url: str | None) -> Writer:
    from spikewatch.observatory.store.db import make_engine, resolve_url

    return Writer(make_engine(resolve_url(url), writer=True))
