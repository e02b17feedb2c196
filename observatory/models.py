"""The observatory's schema (SQLAlchemy 2). Alembic in `migrations/` is the only way it changes.

Long, not wide. Every metric value is one row `(series_id, step, value)` in `points`, where a
*series* is one (run, branch, metric, layer, head). A wide table (one row per step, one column
per metric, or one array per layer) would be smaller per step but fixes the metric set in the
schema while models differ in layers, heads and probes; a range read of one metric would drag
every other metric's bytes through the cache; and SQLite has no arrays to reduce in SQL. Long
rows keyed by a 4-byte series id stay compact (no repeated run ids or names: names live once in
`metric_names`, runs once in `runs`), and the primary key `(series_id, step)` clusters a series
in step order (SQLite `WITHOUT ROWID`), so every chart query is one contiguous index range.

A per-layer or per-head metric is an ordinary series with `layer`/`head` set: a layer x step
matrix is the same range read over 48 series ids. Scalars use `NO_INDEX` (-1) for both.

Millions of rows per run are answered through `point_blocks`: per series, per block of 16, 64,
256 and 4096 steps (`BLOCK_LEVELS`), the exact minimum and maximum (with their steps), the count
and the NaN count.
The writer maintains them in the same transaction as the points (observatory/ingest.py), so a
downsampled query reads a few thousand block rows and only the partial blocks at the edges of the
asked range from `points`. NaN is stored as NULL (SQLite cannot store NaN; PostgreSQL would sort
it above +inf and break max); +inf and -inf are stored as themselves.

`points` and `point_blocks` carry no foreign key to `series`: the per-row referential check
halved PostgreSQL ingest (an RI trigger per row) and the writer only ever uses series ids it
has just read or created. Deleting a run therefore deletes its points explicitly
(`observatory.store.delete_run`).

Branches: a rollback starts branch `n + 1` of the run from the restored step (`fork_step`, the
last step shared with `parent`). Nothing is deleted: the abandoned steps stay on their branch.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "BLOCK_LEVELS",
    "COARSEST_LEVEL",
    "CHECKSUM_STATUSES",
    "EVENT_KINDS",
    "INTERVENTION_KINDS",
    "RUN_STATUSES",
    "Base",
    "Branch",
    "Checkpoint",
    "Event",
    "MetricName",
    "Point",
    "PointBlock",
    "Run",
    "Series",
    "Sweep",
]

# block size of each rollup level, in ascending order (level 0 is `points` itself). Each level
# costs the writer one upserted row per series and batch; 64 (migration 0004) serves the
# 50-250-step buckets of heatmaps over ~10k-100k steps with at most 4 blocks per bucket.
BLOCK_LEVELS: dict[int, int] = {1: 16, 2: 64, 3: 256, 4: 4096}
COARSEST_LEVEL = max(BLOCK_LEVELS)

RUN_STATUSES = ("running", "completed", "failed", "halted", "stopped")
CHECKSUM_STATUSES = ("unverified", "ok", "mismatch", "missing", "writing", "deleted")
INTERVENTION_KINDS = ("rollback", "skip", "lr_change", "halt")
EVENT_KINDS = (
    "spike",
    "nonfinite",
    *INTERVENTION_KINDS,
    "annotation",
    "config_change",
    "note",
    "request",
)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[str]: JSON}


class Run(Base):
    """One training run; `key` is the trainer's run id (the sink's handle)."""

    __tablename__ = "runs"
    __table_args__ = (CheckConstraint(_one_of("status", RUN_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default="running")
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    tags: Mapped[list[str]] = mapped_column(default=list)
    sweep_group: Mapped[str | None] = mapped_column(String(200), index=True)
    hypothesis: Mapped[str | None] = mapped_column(Text)
    run_dir: Mapped[str | None] = mapped_column(String(1000))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Branch(Base):
    """A line of history inside a run: 0 is the original; a rollback forks the next number."""

    __tablename__ = "branches"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    number: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    parent: Mapped[int | None] = mapped_column(SmallInteger)
    fork_step: Mapped[int | None] = mapped_column(Integer)  # last step shared with the parent
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class MetricName(Base):
    """Metric templates (`train/loss`, `layer/*/grad_norm`), stored once, referenced by id."""

    __tablename__ = "metric_names"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)


class Series(Base):
    """One (run, branch, metric, layer, head): the unit the points and blocks hang off."""

    __tablename__ = "series"
    __table_args__ = (
        UniqueConstraint("run_id", "metric_id", "branch", "layer", "head"),
        ForeignKeyConstraint(
            ["run_id", "branch"], ["branches.run_id", "branches.number"], ondelete="CASCADE"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(Integer)
    metric_id: Mapped[int] = mapped_column(ForeignKey("metric_names.id"))
    branch: Mapped[int] = mapped_column(SmallInteger)
    layer: Mapped[int] = mapped_column(SmallInteger)  # NO_INDEX (-1) when not per layer
    head: Mapped[int] = mapped_column(SmallInteger)  # NO_INDEX (-1) when not per head


class Point(Base):
    """One metric value. NULL value = NaN. Clustered by (series_id, step) on SQLite."""

    __tablename__ = "points"
    __table_args__ = {"sqlite_with_rowid": False}

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # no FK: see module doc
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[float | None] = mapped_column(Double)


class PointBlock(Base):
    """Exact extremes of one block of `BLOCK_LEVELS[level]` steps of one series."""

    __tablename__ = "point_blocks"
    __table_args__ = {"sqlite_with_rowid": False}

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # no FK: see module doc
    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    block: Mapped[int] = mapped_column(Integer, primary_key=True)  # first step // block size
    n: Mapped[int] = mapped_column(Integer)
    n_nan: Mapped[int] = mapped_column(Integer)
    nan_step: Mapped[int | None] = mapped_column(Integer)  # first NaN step
    min_value: Mapped[float | None] = mapped_column(Double)  # NULL when all values are NaN
    min_step: Mapped[int | None] = mapped_column(Integer)
    max_value: Mapped[float | None] = mapped_column(Double)
    max_step: Mapped[int | None] = mapped_column(Integer)


class Checkpoint(Base):
    """A checkpoint directory the trainer wrote; `pinned` ones are never deleted by retention."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "path"),
        Index(None, "run_id", "step"),
        CheckConstraint(_one_of("checksum_status", CHECKSUM_STATUSES), name="checksum_status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    branch: Mapped[int] = mapped_column(SmallInteger)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1000))
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    checksum_status: Mapped[str] = mapped_column(String(16), default="unverified")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Event(Base):
    """Spike verdicts, interventions (rollback, skip, lr_change, halt) and annotations.

    `uid` is made by the sender, so a replayed event is recognised and stored once.
    """

    __tablename__ = "events"
    __table_args__ = (
        Index(None, "run_id", "step"),
        CheckConstraint(_one_of("kind", EVENT_KINDS), name="kind"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uid: Mapped[str] = mapped_column(String(64), unique=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    branch: Mapped[int] = mapped_column(SmallInteger)
    step: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32))
    source: Mapped[str] = mapped_column(String(32), default="trainer")
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Sweep(Base):
    """A grid of runs (variants x learning rates x seeds) registered before its first run.

    `hypothesis` is pre-registered: written when the sweep is created and never changed, so the
    compare page can show it beside the outcome. `spec` is the grid as asked (base config,
    variants, learning rates, seeds, overrides). The runs point here by `runs.sweep_group`.
    """

    __tablename__ = "sweeps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    hypothesis: Mapped[str | None] = mapped_column(Text)
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
