"""The samples a rollback named as its spike's cause (issue 39), one row each, written with the
rollback event that names them; upgrade also extracts them from the rollback events already
stored, so an older database has them too.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    samples = op.create_table(
        "samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("event_uid", sa.String(length=64), nullable=False),
        sa.Column("branch", sa.SmallInteger(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("batch", sa.Integer(), nullable=False),
        sa.Column("row", sa.Integer(), nullable=False),
        sa.Column("sample_id", sa.String(length=500), nullable=True),
        sa.Column("loss", sa.Double(), nullable=True),
        sa.Column("grad_norm", sa.Double(), nullable=True),
        sa.Column("preview", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_samples_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_samples")),
        sa.UniqueConstraint(
            "event_uid", "batch", "row", name=op.f("uq_samples_event_uid_batch_row")
        ),
    )
    op.create_index(op.f("ix_samples_run_id"), "samples", ["run_id"], unique=False)
    conn = op.get_bind()
    rows = conn.execute(
        sa.text("SELECT run_id, uid, branch, step, data FROM events WHERE kind = 'rollback'")
    )
    out = []
    for run_id, uid, branch, step, data in rows:
        data = json.loads(data) if isinstance(data, str) else (data or {})
        for s in data.get("samples") or ():
            out.append(
                {
                    "run_id": run_id,
                    "event_uid": uid,
                    "branch": branch,
                    "step": step,
                    "batch": int(s["batch"]),
                    "row": int(s["row"]),
                    "sample_id": s.get("id"),
                    "loss": _number(s.get("loss")),
                    "grad_norm": _number(s.get("grad_norm")),
                    "preview": s.get("preview"),
                }
            )
    if out:
        op.bulk_insert(samples, out)


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) else None  # "nan" (a tagged NaN): unknown


def downgrade() -> None:
    # nothing is lost: the rollback events keep every sample in their data
    op.drop_index(op.f("ix_samples_run_id"), table_name="samples")
    op.drop_table("samples")
