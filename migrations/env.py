"""Alembic environment: the URL comes from spikewatch.observatory.store.db (no alembic.ini,
any working directory)."""

from __future__ import annotations

from alembic import context

from spikewatch.observatory.store.db import make_engine, resolve_url
from spikewatch.observatory.store.models import Base

target_metadata = Base.metadata


def _url() -> str:
    return context.config.attributes.get("url") or resolve_url(None)


def run_migrations_offline() -> None:
    """`--sql` mode: emit the DDL instead of running it."""
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:  # a caller (a test) lends its own connection
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


def _run(connection: object) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # type: ignore[attr-defined]
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
