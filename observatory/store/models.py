"""The observatory's schema (SQLAlchemy 2). Alembic in `migrations/` is the only way it changes.

A *series* is one (run, branch, metric, layer, head): names live once in `metric_names`, runs
once in `runs`, and everything else refers to a series by its 4-byte id. A per-layer or per-head
metric is an ordinary series with `layer`/`head` set (`NO_INDEX`, -1, when not per layer or
head), so a layer x step matrix is a read over 80 series ids.

Values are stored one row per series per window of 512 steps (`point_chunks` for windows the
series has moved past, `point_tails` for its newest; the view `point_windows` is both): the
window's steps and values packed and compressed, with its exact count, NaN count, minimum and
maximum (and their steps) beside them (observatory/store/chunks.py). A 70B-shaped run (80
layers x 64 heads every step) costs about 3.5 bytes per value on both backends
(benchmarks/store_scale.py);
one row per value cost about 20 before rollups (migration 0006). A query of whole windows reads
the summaries only; narrower buckets decode the windows they touch. Every value is kept exactly:
float32 only where the window's values are float32 numbers, NaN and +-inf as themselves.

The window tables carry no foreign key to `series`: the writer only uses series ids it has just
read or created. Deleting a run deletes its windows explicitly
(`spikewatch.observatory.store.queries.delete_run`).

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
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "CHECKSUM_STATUSES",
    "EVENT_KINDS",
    "INTERVENTION_KINDS",
    "RUN_STATUSES",
    "Base",
    "Branch",
    "Checkpoint",
    "Event",
    "MetricName",
    "PointChunk",
    "PointTail",
    "Run",
    "Sample",
    "Series",
    "Sweep",
]

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
    "stall",  # no step ended for longer than the stall bound (trainer/core/watchdog.py)
    "resumed",  # steps end again after a stall
    "slowdown",  # the recent steps slower than the run's own baseline (the same watchdog)
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
    # the process's last sign of life and how often it gives one (queries.run_state: "gone")
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_s: Mapped[float | None] = mapped_column(Double)


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


class _Window:
    """The columns of a stored window (observatory/store/chunks.py) after its key."""

    first_step: Mapped[int] = mapped_column(Integer)
    last_step: Mapped[int] = mapped_column(Integer)
    n: Mapped[int] = mapped_column(Integer)  # values, NaN included
    n_nan: Mapped[int] = mapped_column(Integer)
    nan_step: Mapped[int | None] = mapped_column(Integer)  # first NaN
    min_value: Mapped[float | None] = mapped_column(Double)  # NULL when every value is NaN
    min_step: Mapped[int | None] = mapped_column(Integer)
    max_value: Mapped[float | None] = mapped_column(Double)
    max_step: Mapped[int | None] = mapped_column(Integer)
    steps: Mapped[bytes | None] = mapped_column(LargeBinary)  # NULL: first_step..last_step
    vals: Mapped[bytes] = mapped_column(LargeBinary)


class PointChunk(_Window, Base):
    """A window the series has moved past: written once, never updated (so PostgreSQL keeps no
    dead row versions of it). A rowid table on SQLite: a window's kilobyte or more would spill
    to overflow pages in a WITHOUT ROWID table, whose rows are capped near 1 KB."""

    __tablename__ = "point_chunks"

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # no FK: see module doc
    win: Mapped[int] = mapped_column(Integer, primary_key=True)  # first step // WINDOW


class PointTail(_Window, Base):
    """The newest window of each series, one row per series, rewritten in place as it grows
    and when the series moves on (its old content then goes to `point_chunks`). Its churn stays
    in this small table, as updates of the same rows: PostgreSQL rewrites them on their own
    pages (fillfactor 50) and prunes the old versions as it goes."""

    __tablename__ = "point_tails"

    series_id: Mapped[int] = mapped_column(Integer, primary_key=True)  # no FK: see module doc
    win: Mapped[int] = mapped_column(Integer)


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


class Sample(Base):
    """A row a rollback named as a spike's cause (trainer/core/attribution.py): its batch index
    and row, the data's own id, its loss and gradient norm on the restored weights, and its
    beginning. Written with the rollback event that names it (`event_uid`), so a replayed event
    writes it once; `spikewatch quarantine` exports them as a blocklist."""

    __tablename__ = "samples"
    __table_args__ = (UniqueConstraint("event_uid", "batch", "row"), Index(None, "run_id"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    event_uid: Mapped[str] = mapped_column(String(64))
    branch: Mapped[int] = mapped_column(SmallInteger)
    step: Mapped[int | None] = mapped_column(Integer)  # the rollback's detection step
    batch: Mapped[int] = mapped_column(Integer)
    row: Mapped[int] = mapped_column(Integer)
    sample_id: Mapped[str | None] = mapped_column(String(500))
    loss: Mapped[float | None] = mapped_column(Double)
    grad_norm: Mapped[float | None] = mapped_column(Double)
    preview: Mapped[str | None] = mapped_column(Text)


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
