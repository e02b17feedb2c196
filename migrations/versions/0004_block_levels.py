"""A rollup level of 64-step blocks: levels 16, 64, 256, 4096 steps (issue 7).

A query reads whole blocks of the largest size not wider than its bucket, so with 16 and 256 a
bucket of 64-255 steps needed up to 16 blocks per series (a 300-column heatmap of 20k steps read
1,250 rows per layer); with 64 it needs at most 4. (A 1,024 level too cost the writer 40% of its
ingest rate in benchmarks/store.py: every level is one more upserted row per series and batch.)
Existing blocks are kept and renumbered (256 -> level 3, 4096 -> level 4); level 2 is reduced
from level 1 in SQL, with the extremes' ties going to the earliest step as the writer's do
(observatory/rollup.py).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _reduce(new: int, src: str) -> str:
    """INSERT of level `new` from level `src` (4x smaller blocks); ties to the earliest step."""
    g = "block / 4"
    first = (
        "SELECT series_id, g, {value}, {step} FROM ("
        f"SELECT series_id, {g} AS g, {{value}}, {{step}}, ROW_NUMBER() OVER "
        f"(PARTITION BY series_id, {g} ORDER BY {{order}}, {{step}}) AS rn "
        f"FROM point_blocks WHERE level = {src} AND {{value}} IS NOT NULL) AS ranked WHERE rn = 1"
    )
    mn = first.format(value="min_value", step="min_step", order="min_value")
    mx = first.format(value="max_value", step="max_step", order="max_value DESC")
    return f"""
INSERT INTO point_blocks
  (series_id, level, block, n, n_nan, nan_step, min_value, min_step, max_value, max_step)
SELECT a.series_id, {new}, a.g, a.n, a.n_nan, a.nan_step,
       mn.min_value, mn.min_step, mx.max_value, mx.max_step
FROM (SELECT series_id, {g} AS g, SUM(n) AS n, SUM(n_nan) AS n_nan, MIN(nan_step) AS nan_step
      FROM point_blocks WHERE level = {src} GROUP BY series_id, {g}) AS a
LEFT JOIN ({mn}) AS mn ON mn.series_id = a.series_id AND mn.g = a.g
LEFT JOIN ({mx}) AS mx ON mx.series_id = a.series_id AND mx.g = a.g"""


def upgrade() -> None:
    op.execute("UPDATE point_blocks SET level = 4 WHERE level = 3")
    op.execute("UPDATE point_blocks SET level = 3 WHERE level = 2")
    op.execute(_reduce(2, "1"))


def downgrade() -> None:
    op.execute("DELETE FROM point_blocks WHERE level = 2")
    op.execute("UPDATE point_blocks SET level = 2 WHERE level = 3")
    op.execute("UPDATE point_blocks SET level = 3 WHERE level = 4")
