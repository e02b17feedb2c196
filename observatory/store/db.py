"""Where the store lives and how to connect: URL resolution, engines, `upgrade` (Alembic).

The default is a SQLite file, `runs/spikewatch.db`, in WAL mode so the dashboard reads while the
trainer writes. `SPIKEWATCH_DB_URL=postgresql+psycopg://...` switches to a shared PostgreSQL.
Writer engines (the sink) open SQLite transactions with `BEGIN IMMEDIATE`: two writers then queue
on the busy timeout instead of deadlocking on a read-to-write lock upgrade.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not on Windows: no lock there
    fcntl = None  # type: ignore[assignment]

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

__all__ = [
    "DEFAULT_URL",
    "ENV_VAR",
    "store_url",
    "MIGRATIONS_DIR",
    "DatabaseURLError",
    "StoreUnreachable",
    "make_engine",
    "redact",
    "resolve_url",
    "upgrade",
]

log = logging.getLogger(__name__)

ENV_VAR = "SPIKEWATCH_DB_URL"
DEFAULT_URL = "sqlite:///runs/spikewatch.db"


# migrations/ sits next to the package in the source tree; resolved from here, not from the CWD
def _migrations_dir() -> Path:
    """The Alembic environment: inside the installed package (observatory/migrations, a wheel's
    copy of the checkout's migrations/), else the checkout's migrations/ (the source tree)."""
    spec = importlib.util.find_spec("spikewatch.observatory.migrations")
    for where in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(where) / "env.py").is_file():
            return Path(where)
    return Path(__file__).resolve().parents[2] / "migrations"


MIGRATIONS_DIR = _migrations_dir()
SQLITE_BUSY_MS = 30_000
PG_CONNECT_TIMEOUT_S = 10


class DatabaseURLError(ValueError):
    """A database URL that spikewatch cannot use (says which and why)."""


class StoreUnreachable(DatabaseURLError):
    """The store at a URL cannot be opened: the server is down, the role or database does not
    exist, the file cannot be written. One line, in every command and in the Watch (it was a
    134-line traceback from inside the Alembic environment)."""


def store_url(url: str | None = None) -> str:
    """The one rule every entry point records by and `spikewatch serve` reads by: an explicit
    URL, else $SPIKEWATCH_DB_URL, else `runs/spikewatch.db` in the current directory (made
    absolute, and its folder created, so the line a run prints names the file itself)."""
    url = url or os.environ.get(ENV_VAR)
    if url is None:
        path = Path.cwd() / make_url(DEFAULT_URL).database  # type: ignore[operator]
        path.parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{path}"
    return url


def serve_hint(url: str) -> str:
    """The command that shows a store's runs, for the line each run prints at start."""
    if os.environ.get(ENV_VAR) == url:
        return "spikewatch serve"
    default = Path.cwd() / str(make_url(DEFAULT_URL).database)
    if url == f"sqlite:///{default}":
        return "spikewatch serve  (from this directory)"
    return f"spikewatch serve --db '{redact(url)}'"


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
    if not is_sqlite(url):  # a server that vanished (no reset) must not hang a connect forever
        if "connect_timeout" not in make_url(url).query:
            args = kwargs.setdefault("connect_args", {})
            args.setdefault("connect_timeout", PG_CONNECT_TIMEOUT_S)
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
    url = resolve_url(url)
    with _alembic_below_info():  # its import logs too (a line per plugin)
        from alembic import command
        from sqlalchemy.exc import DBAPIError

        try:
            with _migration_lock(url):
                command.upgrade(alembic_config(url), revision)
        except DBAPIError as e:
            raise StoreUnreachable(unreachable(url, e)) from None
    return url


def unreachable(url: str, error: BaseException, doing: str = "open the store at") -> str:
    """One line for a store that cannot be used: what, where, and the driver's own first line
    (SQLAlchemy's text wraps it in its own lines and a link)."""
    cause = getattr(error, "orig", None) or error
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return f"cannot {doing} {redact(url)}: {first}"


@contextlib.contextmanager
def _alembic_below_info() -> Iterator[None]:
    """Alembic says each migration at INFO (~15 lines for a new store): in a user's log at INFO
    they would drown spikewatch's own start line. They go out at WARNING and above, unless the
    program set alembic's level itself (or spikewatch's logger is at DEBUG: `-v`)."""
    alembic = logging.getLogger("alembic")
    if alembic.level != logging.NOTSET or log.isEnabledFor(logging.DEBUG):
        yield
        return
    alembic.setLevel(logging.WARNING)
    try:
        yield
    finally:
        alembic.setLevel(logging.NOTSET)


@contextlib.contextmanager
def _migration_lock(url: str) -> Iterator[None]:
    """Two processes started at once on a new SQLite file (two scripts in one directory) would
    both create the tables, and one fail with 'database is locked': they take turns on a lock
    file beside it. PostgreSQL's migrations run in one transaction each and need none."""
    parsed = make_url(url)
    path = parsed.database if parsed.get_backend_name() == "sqlite" else None
    if not path or path == ":memory:" or fcntl is None:
        yield
        return
    lock = Path(path).with_name(Path(path).name + ".migrate-lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
            f"Alembic environment not found at {MIGRATIONS_DIR}: this spikewatch installation "
            "lacks its migrations (reinstall it: pip install spikewatch-*.whl, or pip install -e .)"
        )
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["url"] = url  # not set_main_option: ConfigParser would mangle '%' in passwords
    return cfg
