"""Alembic: head matches the models (no autogenerate drift), downgrade really drops, CLI works."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, inspect, text

from observatory import db
from observatory.ingest import Writer
from observatory.models import BLOCK_LEVELS, Base
from trainer.cli import main

from .helpers import assert_blocks_consistent

TABLES = {
    "runs",
    "branches",
    "metric_names",
    "series",
    "points",
    "point_blocks",
    "checkpoints",
    "events",
    "sweeps",
}


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_fresh_database_at_head_has_no_drift(db_url: str) -> None:
    engine = db.make_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(
            MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
        )
    engine.dispose()
    assert diff == []
    assert _tables(db_url) == TABLES


def test_downgrade_drops_everything_and_upgrade_restores(db_url: str) -> None:
    db.downgrade(db_url, revision="base")
    assert _tables(db_url) == set()
    db.upgrade(db_url)
    assert _tables(db_url) == TABLES


def test_cli_db_upgrade_fresh_sqlite_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # migrations/ must be found from the package, not the CWD
    monkeypatch.delenv(db.ENV_VAR, raising=False)
    assert main(["db", "upgrade"]) == 0
    assert (tmp_path / "runs" / "spikewatch.db").is_file()
    assert _tables(f"sqlite:///{tmp_path}/runs/spikewatch.db") == TABLES


def test_cli_db_upgrade_postgresql(pg_schema_url: str) -> None:
    assert main(["db", "upgrade", "--db", pg_schema_url]) == 0
    assert _tables(pg_schema_url) == TABLES


def test_env_var_selects_the_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path}/from_env.db"
    monkeypatch.setenv(db.ENV_VAR, url)
    assert main(["db", "upgrade"]) == 0
    assert _tables(url) == TABLES


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://u@h/d", "only sqlite:/// and postgresql+psycopg://"),
        ("postgresql+asyncpg://u@h/d", "psycopg (v3) driver"),
        ("not a url", "not a database URL"),
    ],
)
def test_bad_urls_are_refused_with_a_reason(
    url: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(db.DatabaseURLError, match=re.escape(message)):
        db.resolve_url(url)
    assert main(["db", "upgrade", "--db", url]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_postgresql_is_a_clear_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "--db", "postgresql://postgres@127.0.0.1:9/x"]) == 2
    assert "cannot use postgresql+psycopg://postgres@127.0.0.1:9/x" in capsys.readouterr().err


def test_plain_postgresql_scheme_uses_psycopg() -> None:
    assert db.resolve_url("postgresql://u:p@h/d") == "postgresql+psycopg://u:p@h/d"
    assert db.redact("postgresql+psycopg://u:secret@h/d") == "postgresql+psycopg://u:***@h/d"


def _blocks(engine: Engine) -> list[tuple[object, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text("SELECT * FROM point_blocks ORDER BY 1, 2, 3"))]


def test_0004_builds_the_64_step_level_exactly(db_url: str) -> None:
    """Blocks written at head, taken down to 0003's levels (16, 256, 4096) and up again, come back
    identical: the migration's SQL reduction agrees with the writer's (ties to the earliest step,
    NaNs)."""
    rng = np.random.default_rng(3)
    steps = np.arange(5_000)
    values = rng.integers(0, 4, len(steps)).astype(float)  # many ties within each block
    values[rng.random(len(steps)) < 0.05] = np.nan
    values[1024:1100] = np.nan  # a block of NaNs only
    values[2000] = np.inf
    engine = db.make_engine(db_url, writer=True)
    writer = Writer(engine)
    writer.write_series("r", 0, "train/loss", steps, values)
    writer.write_series("r", 0, "optim/lr", steps[::3], values[::3])
    at_head = _blocks(engine)
    assert {r[1] for r in at_head} == set(BLOCK_LEVELS)
    assert_blocks_consistent(engine)

    db.downgrade(db_url, revision="0003")
    old = _blocks(engine)
    assert {r[1] for r in old} == {1, 2, 3}
    assert [r[2:] for r in old if r[1] == 3] == [r[2:] for r in at_head if r[1] == 4]

    db.upgrade(db_url)
    assert _blocks(engine) == at_head
    engine.dispose()
