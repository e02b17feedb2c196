"""Initial schema: runs, branches, metric names, series, points, point blocks, checkpoints, events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 11:11:54.287900
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "metric_names",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metric_names")),
        sa.UniqueConstraint("name", name=op.f("uq_metric_names_name")),
    )
    op.create_table(
        "point_blocks",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("level", sa.SmallInteger(), nullable=False),
        sa.Column("block", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("n_nan", sa.Integer(), nullable=False),
        sa.Column("nan_step", sa.Integer(), nullable=True),
        sa.Column("min_value", sa.Double(), nullable=True),
        sa.Column("min_step", sa.Integer(), nullable=True),
        sa.Column("max_value", sa.Double(), nullable=True),
        sa.Column("max_step", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("series_id", "level", "block", name=op.f("pk_point_blocks")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "points",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("series_id", "step", name=op.f("pk_points")),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("sweep_group", sa.String(length=200), nullable=True),
        sa.Column("hypothesis", sa.Text(), nullable=True),
        sa.Column("run_dir", sa.String(length=1000), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('running', 'completed', 'failed', 'halted', 'stopped')",
            name=op.f("ck_runs_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("key", name=op.f("uq_runs_key")),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_sweep_group"), ["sweep_group"], unique=False)

    op.create_table(
        "branches",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.SmallInteger(), nullable=False),
        sa.Column("parent", sa.SmallInteger(), nullable=True),
        sa.Column("fork_step", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_branches_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "number", name=op.f("pk_branches")),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("branch", sa.SmallInteger(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(length=1000), nullable=False),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("checksum_status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "checksum_status IN ('unverified', 'ok', 'mismatch', 'missing')",
            name=op.f("ck_checkpoints_checksum_status"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "path", name=op.f("uq_checkpoints_run_id_path")),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_checkpoints_run_id_step"), ["run_id", "step"], unique=False
        )

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("uid", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("branch", sa.SmallInteger(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("source", sa.String(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "kind IN ('spike', 'nonfinite', 'rollback', 'skip', 'lr_change', 'halt', "
            "'annotation', 'config_change', 'note')",
            name=op.f("ck_events_kind"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_events_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint("uid", name=op.f("uq_events_uid")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_run_id_step"), ["run_id", "step"], unique=False)

    op.create_table(
        "series",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("metric_id", sa.Integer(), nullable=False),
        sa.Column("branch", sa.SmallInteger(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("head", sa.SmallInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["metric_id"], ["metric_names.id"], name=op.f("fk_series_metric_id_metric_names")
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "branch"],
            ["branches.run_id", "branches.number"],
            name=op.f("fk_series_run_id_branches"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_series")),
        sa.UniqueConstraint(
            "run_id",
            "metric_id",
            "branch",
            "layer",
            "head",
            name=op.f("uq_series_run_id_metric_id_branch_layer_head"),
        ),
    )


def downgrade() -> None:
    op.drop_table("series")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_run_id_step"))

    op.drop_table("events")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoints_run_id_step"))

    op.drop_table("checkpoints")
    op.drop_table("branches")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_sweep_group"))

    op.drop_table("runs")
    op.drop_table("points")
    op.drop_table("point_blocks")
    op.drop_table("metric_names")
