"""Databases for the observatory tests: a fresh SQLite file, and a fresh PostgreSQL schema.

PostgreSQL comes from $SPIKEWATCH_TEST_PG_URL (`.ci/run` sets it to the local server); each test
gets its own schema (dropped afterwards) through libpq's `options=-csearch_path=...`, so tests
never see each other's tables and nothing is left behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from spikewatch.observatory.store import db

PG_ENV = "SPIKEWATCH_TEST_PG_URL"


def pg_base_url() -> str:
    url = os.environ.get(PG_ENV)
    if not url:
        pytest.skip(
            f"PostgreSQL tests need ${PG_ENV} (set by .ci/run), e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test"
        )
    return db.resolve_url(url)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/spikewatch.db"
    db.upgrade(url)
    return url


@pytest.fixture
def pg_schema_url() -> Iterator[str]:
    """A URL whose search_path is a new, empty schema; not migrated."""
    base = pg_base_url()
    schema = f"sw_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


@pytest.fixture
def pg_url(pg_schema_url: str) -> str:
    db.upgrade(pg_schema_url)
    return pg_schema_url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Every test that takes `db_url` runs once on SQLite and once on PostgreSQL."""
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return request.getfixturevalue(name)
