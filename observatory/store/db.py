"""Where the store lives and how to connect: URL resolution, engines, `upgrade` (Alembic).

The default is a SQLite file, `runs/spikewatch.db`, in WAL mode so the dashboard reads while the
trainer writes. `SPIKEWATCH_DB_URL=postgresql+psycopg://...` switches to a shared PostgreSQL.
Writer engines (the sink) open SQLite transactions with `BEGIN IMMEDIATE`: two writers then queue
on the busy timeout instead of deadlocking on a read-to-write lock upgrade.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

__all__ = [
    "DEFAULT_URL",
    "ENV_VAR",
    "url_for_run",
    "MIGRATIONS_DIR",
    "DatabaseURLError",
    "make_engine",
    "redact",
    "resolve_url",
    "upgrade",
]

log = logging.getLogger(__name__)

ENV_VAR = "SPIKEWATCH_DB_URL"
DEFAULT_URL = "sqlite:///runs/spikewatch.db"
# migrations/ sits next to the package in the source tree; resolved from here, not from the CWD
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
SQLITE_BUSY_MS = 30_000


class DatabaseURLError(ValueError):
    """A database URL that spikewatch cannot use (says which and why)."""


def url_for_run(run_dir: str | os.PathLike[str], url: str | None = None) -> str:
    """Explicit URL > $SPIKEWATCH_DB_URL > spikewatch.db beside the run directory (so every run
    under runs/ lands in runs/spikewatch.db, the file `spikewatch serve` opens by default)."""
    url = url or os.environ.get(ENV_VAR)
    if url is None:
        parent = Path(run_dir).resolve().parent
        parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{parent / 'spikewatch.db'}"
    return url


def resolve_url(url: str | None = None) -> str:
    """Explicit URL > $SPIKEWATCH_DB_URL > the default SQLite file; normalise the driver."""
    raw = url or os.environ.get(ENV_VAR) or DEFAULT_URL
    try:
        parsed = make_url(raw)
    except Exception as e:  # sqlalchemy raises ArgumentError with a terse text
        raise DatabaseURLError(f"not a database URL: {raw!r} ({e})") from e
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
            parsed = parsed.set(drivername="postgresql+psycopg")
        if parsed.drivername != "postgresql+psycopg":
            raise DatabaseURLError(
                f"use the psycopg (v3) driver: postgresql+psycopg://, not {raw!r}"
            )
    elif backend != "sqlite":
        raise DatabaseURLError(f"only sqlite:/// and postgresql+psycopg:// are supported: {raw!r}")
    return parsed.render_as_string(hide_password=False)


def redact(url: str) -> str:
    """The URL with its password hidden, for logs and error messages."""
    return make_url(url).render_as_string(hide_password=True)


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(
    url: str | None = None,
    *,
    writer: bool = False,
    sqlite_busy_ms: int = SQLITE_BUSY_MS,
    **kwargs: Any,
) -> Engine:
    """An engine for `url` (resolved); SQLite gets WAL, a busy timeout and foreign keys."""
    url = resolve_url(url)
    if not is_sqlite(url):
        return create_engine(url, pool_pre_ping=True, **kwargs)
    kwargs.setdefault("connect_args", {}).setdefault("timeout", busy_ms_to_s(sqlite_busy_ms))
    database = make_url(url).database
    if database and database != ":memory:" and not database.startswith("file:"):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, **kwargs)
    _sqlite_pragmas(engine, writer=writer, busy_ms=sqlite_busy_ms)
    return engine


def busy_ms_to_s(ms: int) -> float:
    return ms / 1000.0


def _sqlite_pragmas(engine: Engine, *, writer: bool, busy_ms: int) -> None:
    """WAL + busy timeout on every connection; we issue BEGIN ourselves (pysqlite's is lazy)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # autocommit at the driver; BEGIN comes from "begin"
        cur = dbapi_conn.cursor()
        # a new database only (no-op on an existing one): stored windows are 1-3 KB, and a
        # 4 KB page holding one or two of them wastes a quarter of the file
        cur.execute("PRAGMA page_size=16384")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
        cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across app crashes
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA temp_store=MEMORY")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if writer else "BEGIN")


def upgrade(url: str | None = None, *, revision: str = "head") -> str:
    """Run Alembic migrations up to `revision`; return the resolved URL (for the caller's log)."""
    from alembic import command

    url = resolve_url(url)
    command.upgrade(alembic_config(url), revision)
    return url


def downgrade(url: str | None = None, *, revision: str = "base") -> str:
    """Run Alembic migrations down to `revision` (base drops every table)."""
    from alembic import command

    url = resolve_url(url)
    command.downgrade(alembic_config(url), revision)
    return url


def alembic_config(url: str) -> Any:
    """An Alembic Config that needs no alembic.ini and works from any working directory."""
    from alembic.config import Config

    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(
            f"Alembic environment not found at {MIGRATIONS_DIR}; spikewatch must be installed from "
            "a source checkout (pip install -e .) so migrations/ sits next to observatory/"
        )
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["url"] = url  # not set_main_option: ConfigParser would mangle '%' in passwords
    return cfg
