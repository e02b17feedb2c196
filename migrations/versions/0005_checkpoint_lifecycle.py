"""Checkpoint statuses 'writing' (an asynchronous save still in flight) and 'deleted' (removed
by retention or by a rollback), so the run page tells which checkpoints exist now.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = ("unverified", "ok", "mismatch", "missing")
NEW = (*OLD, "writing", "deleted")


def _statuses(statuses: tuple[str, ...]) -> str:
    return "checksum_status IN (" + ", ".join(f"'{s}'" for s in statuses) + ")"


def _check(statuses: tuple[str, ...]) -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("ck_checkpoints_checksum_status"), type_="check")
        batch_op.create_check_constraint(
            batch_op.f("ck_checkpoints_checksum_status"), _statuses(statuses)
        )


def upgrade() -> None:
    _check(NEW)


def downgrade() -> None:
    # 'deleted' rows are history the old schema cannot say: it only listed what was written.
    op.execute("DELETE FROM checkpoints WHERE checksum_status = 'deleted'")
    op.execute(
        "UPDATE checkpoints SET checksum_status = 'unverified' WHERE checksum_status = 'writing'"
    )
    _check(OLD)
