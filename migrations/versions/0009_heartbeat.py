"""A run's heartbeat: when its process last said it is alive, and how often it says so. A run
still "running" whose heartbeat is older than two periods has no process any more (a SIGKILL,
an out-of-memory kill): it reads "gone" (observatory/store/queries.py: run_state).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("heartbeat_s", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("heartbeat_s")
        batch_op.drop_column("heartbeat_at")
