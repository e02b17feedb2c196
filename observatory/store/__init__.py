"""The store: everything that touches the database.

- `queries` (re-exported here, so `from observatory import store; store.series(...)`): the reads
  the dashboard and the reports make; all their SQL.
- `sink` (with `spool`): the trainer's never-blocking write path; `ingest`: one batch of
  records -> one idempotent transaction; `records`: what travels between them.
- `models` (the schema, changed only through Alembic in migrations/), `db` (URLs, engines,
  upgrades), `chunks` (values packed per series and window), `downsample` (bucketed reads),
  `across_runs` (reads over many runs at a fixed number of statements), `names` (metric names
  split into template, layer and head).
"""

from spikewatch.observatory.store.queries import (
    LOSS_METRIC,
    BranchRow,
    Bucket,
    CheckpointRow,
    EventRow,
    Matrix,
    NotFoundError,
    RunSummary,
    SampleRow,
    SeriesData,
    branches,
    checkpoints,
    delete_run,
    events,
    get_run,
    head_matrix,
    layer_matrix,
    list_runs,
    metric_names,
    run_state,
    samples,
    series,
    session_factory,
)

__all__ = [
    "LOSS_METRIC",
    "BranchRow",
    "Bucket",
    "CheckpointRow",
    "EventRow",
    "Matrix",
    "NotFoundError",
    "RunSummary",
    "run_state",
    "SampleRow",
    "SeriesData",
    "branches",
    "checkpoints",
    "delete_run",
    "events",
    "get_run",
    "head_matrix",
    "layer_matrix",
    "list_runs",
    "metric_names",
    "samples",
    "series",
    "session_factory",
]
