"""Event kinds 'stall', 'resumed' and 'slowdown': no step ended for longer than the stall bound,
steps ending again, and steps slower than the run's own pace (trainer/core/watchdog.py).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = (
    "spike",
    "nonfinite",
    "rollback",
    "skip",
    "lr_change",
    "halt",
    "annotation",
    "config_change",
    "note",
    "request",
)
NEW = (*OLD, "stall", "resumed", "slowdown")


def _kinds(kinds: tuple[str, ...]) -> str:
    return "kind IN (" + ", ".join(f"'{k}'" for k in kinds) + ")"


def upgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("ck_events_kind"), type_="check")
        batch_op.create_check_constraint(batch_op.f("ck_events_kind"), _kinds(NEW))


def downgrade() -> None:
    op.execute("DELETE FROM events WHERE kind IN ('stall', 'resumed', 'slowdown')")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("ck_events_kind"), type_="check")
        batch_op.create_check_constraint(batch_op.f("ck_events_kind"), _kinds(OLD))
