"""The dashboard's application factory: the JSON API under /api, the pages, the SSE stream."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from spikewatch.observatory.goodput.parallel import warm
from spikewatch.observatory.store.queries import NotFoundError, session_factory
from spikewatch.web.routes import compare, control, goodput, pages, runs
from spikewatch.web.schemas import errors
from spikewatch.web.settings import Settings, get_settings

__all__ = ["create_app", "create_default_app"]


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Everything alive at startup (modules, the app, the ORM) moves out of the cyclic
    # collector's reach: a chart request allocates tens of thousands of objects, and full
    # collections that walk every startup object were most of its tail latency (p95 243 ->
    # 64 ms for a 2,000-bucket series, benchmarks/dashboard.py). Refcounting still frees them.
    gc.freeze()
    yield


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(
        title="spikewatch",
        description="Loss-spike observatory: runs, series, spikes and interventions.",
        version="0.1.0",
        lifespan=_lifespan,
    )
    app.state.settings = settings
    app.state.sessions = session_factory(settings.db_url)
    warm()  # the goodput page's helper processes, started ahead (goodput/parallel.py)
    reader = [Depends(control.require_read_token)]
    read_errors = errors(400, 401, 403, 404)
    app.include_router(runs.router, dependencies=reader, responses=read_errors)
    app.include_router(pages.router, dependencies=reader, responses=read_errors)
    app.include_router(compare.router, dependencies=reader, responses=read_errors)
    app.include_router(goodput.router, dependencies=reader, responses=read_errors)
    app.include_router(control.router)
    app.state.writer = control.make_writer(settings.db_url)
    app.state.write_lock = threading.Lock()

    @app.middleware("http")
    async def remember_token(request: Request, call_next):
        """`?token=` on a page sets the read cookie, so scripts and live streams carry it."""
        response = await call_next(request)
        token = request.query_params.get("token")
        if token and settings.read_token and response.status_code < 400:
            response.set_cookie(control.READ_COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(NotFoundError)
    def not_found(request: Request, exc: NotFoundError) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": str(exc)})

    @app.exception_handler(ValueError)
    def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        """400, not 422: 422 is FastAPI's own validation error, with its own body shape."""
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    return app


def create_default_app() -> FastAPI:
    """For `uvicorn --factory` (what `spikewatch serve` runs): settings from the environment."""
    return create_app(get_settings())
