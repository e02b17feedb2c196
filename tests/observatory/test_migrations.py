"""Alembic: head matches the models (no autogenerate drift), downgrade really drops, CLI works."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Engine, inspect, text

from spikewatch.observatory.store import db
from spikewatch.observatory.store.ingest import Writer
from spikewatch.observatory.store.models import Base
from spikewatch.trainer.cli import main

from .helpers import assert_windows_consistent, stored_points

TABLES = {
    "runs",
    "branches",
    "metric_names",
    "series",
    "point_chunks",
    "point_tails",
    "checkpoints",
    "events",
    "sweeps",
    "samples",
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


@pytest.mark.parametrize("command", [["db", "upgrade"], ["serve"], ["follow", "LOG"], ["runs"]])
def test_an_unreachable_store_is_one_line_in_every_command(
    command: list[str], capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    """A refused port: one line naming the store and the driver's reason, exit 2 (it was a
    134-line traceback from inside the Alembic environment in serve and follow)."""
    log = tmp_path / "loss.csv"
    log.write_text("step,loss\n1,2.0\n")
    args = [str(log) if a == "LOG" else a for a in command]
    assert main([*args, "--db", "postgresql://postgres@127.0.0.1:9/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "cannot " in err[0] and "postgresql+psycopg://postgres@127.0.0.1:9/x" in err[0]
    assert "refused" in err[0] or "failed" in err[0], err


def test_an_unreachable_store_stops_the_watch_with_that_line(tmp_path) -> None:
    import torch

    from spikewatch import AdamW, Watch

    model = torch.nn.Linear(2, 1)
    watch = Watch(model, AdamW(model.parameters()), run_dir=tmp_path,
                  db="postgresql://postgres@127.0.0.1:9/x")  # fmt: skip
    with pytest.raises(db.StoreUnreachable, match=r"cannot open the store at postgresql\+psycopg://"
                       r"postgres@127.0.0.1:9/x: connection failed") as caught:  # fmt: skip
        watch.open()
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_plain_postgresql_scheme_uses_psycopg() -> None:
    assert db.resolve_url("postgresql://u:p@h/d") == "postgresql+psycopg://u:p@h/d"
    assert db.redact("postgresql+psycopg://u:secret@h/d") == "postgresql+psycopg://u:***@h/d"


def _rows(engine: Engine, sql: str) -> list[tuple[object, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def test_0006_packs_every_value_exactly_and_unpacks_them_again(db_url: str) -> None:
    """Values written at head, taken down to 0005 (one row per value, rollup blocks) and up
    again: the old rows hold every value (NaN as NULL), the rebuilt blocks agree with them, and
    the windows packed by the upgrade are byte-identical to the writer's."""
    rng = np.random.default_rng(3)
    steps = np.arange(5_000)
    values = rng.integers(0, 4, len(steps)).astype(float)  # many ties
    values[rng.random(len(steps)) < 0.05] = np.nan
    values[1024:1100] = np.nan
    values[2000], values[2001] = np.inf, -np.inf
    lr = 1e-3 * np.cos(steps / 700.0)  # not float32 numbers: must come back exactly
    engine = db.make_engine(db_url, writer=True)
    writer = Writer(engine)
    writer.write_series("r", 0, "train/loss", steps, values)
    writer.write_series("r", 0, "optim/lr", steps[::3], lr[::3])  # steps not contiguous
    at_head = _rows(engine, "SELECT * FROM point_windows ORDER BY series_id, win")
    points = stored_points(engine)
    assert len(points) == 5_000 + len(steps[::3])
    loss_sid, lr_sid = points[0][0], points[-1][0]
    assert [v for sid, s, v in points if sid == loss_sid][2000:2002] == [np.inf, -np.inf]
    assert [v for sid, _, v in points if sid == lr_sid] == lr[::3].tolist()

    db.downgrade(db_url, revision="0005")
    old = _rows(engine, "SELECT series_id, step, value FROM points ORDER BY series_id, step")
    assert old == [(sid, s, None if np.isnan(v) else v) for sid, s, v in points]
    for size, level in ((16, 1), (64, 2), (256, 3), (4096, 4)):
        want = _rows(
            engine,
            f"SELECT series_id, step / {size}, COUNT(*), COUNT(*) - COUNT(value), MIN(value), "
            f"MAX(value) FROM points GROUP BY series_id, step / {size} ORDER BY 1, 2",
        )
        got = _rows(
            engine,
            "SELECT series_id, block, n, n_nan, min_value, max_value FROM point_blocks "
            f"WHERE level = {level} ORDER BY 1, 2",
        )
        assert got == want, level

    db.upgrade(db_url)
    assert _rows(engine, "SELECT * FROM point_windows ORDER BY series_id, win") == at_head
    assert_windows_consistent(engine)
    engine.dispose()
