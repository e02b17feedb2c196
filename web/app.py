"""The dashboard's application factory: the JSON API under /api, the pages, the SSE stream."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from observatory.store import NotFoundError, session_factory
from web.routes import control, pages, runs
from web.settings import Settings, get_settings

__all__ = ["create_app", "create_default_app"]


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(
        title="spikewatch",
        description="Loss-spike observatory: runs, series, spikes and interventions.",
        version="0.1.0",
    )
    app.state.settings = settings
    app.state.sessions = session_factory(settings.db_url)
    app.include_router(runs.router)
    app.include_router(pages.router)
    app.include_router(control.router)
    app.state.writer = control.make_writer(settings.db_url)

    @app.exception_handler(NotFoundError)
    def not_found(request: Request, exc: NotFoundError) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": str(exc)})

    @app.exception_handler(ValueError)
    def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"detail": str(exc)})

    return app


def create_default_app() -> FastAPI:
    """For `uvicorn --factory` (what `spikewatch serve` runs): settings from the environment."""
    return create_app(get_settings())
