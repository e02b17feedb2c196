"""Every query the dashboard and tools need: keyword-only, typed, returning plain dataclasses.

Series are downsampled to at most N buckets by minimum and maximum (M4-style, without
first/last), each bucket keeping its exact extremes and the steps they occurred at, so a one-step
spike survives any zoom level. A bucket at least a stored window wide (512 steps) is a whole
number of windows and is answered from the windows' stored summaries; narrower buckets decode
the windows they touch (observatory/store/downsample.py). NaN is counted per bucket (`n_nan`, first
`nan_step`); +-inf appear as the bucket's exact min or max.

"History of branch b" is its lineage: the parent's steps up to the fork step, then b's own.
`branch="all"` returns every branch's own steps separately, abandoned ones included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
from sqlalchemy import Engine, bindparam, delete, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.store.chunks import decode
from spikewatch.observatory.store.db import make_engine
from spikewatch.observatory.store.downsample import (
    END,
    MAX_BUCKETS,
    Tree,
    branch_tree,
    downsample,
    downsample_buckets,
    lineage,
)
from spikewatch.observatory.store.models import (
    Branch,
    Checkpoint,
    Event,
    MetricName,
    PointChunk,
    PointTail,
    Run,
    Sample,
    Series,
)
from spikewatch.observatory.store.names import NO_INDEX, MetricKey, parse_name

__all__ = [
    "LOSS_METRIC",
    "Bucket",
    "CheckpointRow",
    "EventRow",
    "Matrix",
    "MatrixPlan",
    "NotFoundError",
    "RunSummary",
    "SeriesData",
    "SeriesPlan",
    "branches",
    "checkpoints",
    "delete_run",
    "events",
    "get_run",
    "head_matrix",
    "layer_matrix",
    "list_runs",
    "metric_names",
    "read_matrices",
    "read_series",
    "series",
    "session_factory",
]

Extremes = Literal["both", "max"]
LOSS_METRIC = M.LOSS


class NotFoundError(LookupError):
    """No such run / metric / branch; the message lists what exists."""


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    name: str | None
    status: str
    tags: list[str]
    sweep_group: str | None
    hypothesis: str | None
    config: dict[str, Any]
    run_dir: str | None
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    branches: int
    last_step: int | None
    last_loss: float | None
    spikes: int
    rollbacks: int
    stalled: bool = False  # a stall recorded and no step ended since (core/watchdog.py)
    heartbeat_at: datetime | None = None  # the process's last sign of life (core/watchdog.py)
    heartbeat_s: float | None = None  # ... given every this many seconds
    state: str = ""  # run_state's word for it when it was read


SILENT_S = 120  # a running run with no heartbeat that wrote nothing for longer: "silent"


def run_state(run: RunSummary, now: datetime) -> str:
    """What a run is doing, in one word: its status once it ended (completed, failed, halted,
    stopped); "stalled" while its watchdog's stall has no `resumed` after it; "gone" when its
    heartbeat is older than two periods (no process: a SIGKILL, an out-of-memory kill); else
    "live", or "silent" for a run with no heartbeat (a follower's, an older writer's) that
    wrote nothing for SILENT_S."""
    if run.status != "running":
        return run.status
    if run.heartbeat_at is not None and run.heartbeat_s:
        if (now - run.heartbeat_at).total_seconds() > 2 * run.heartbeat_s:
            return "gone"
    if run.stalled:
        return "stalled"
    if run.heartbeat_at is None and (now - run.updated_at).total_seconds() > SILENT_S:
        return "silent"
    return "live"


@dataclass(frozen=True)
class Bucket:
    start: int  # first step of the bucket (inclusive)
    end: int  # last step (inclusive)
    n: int  # values stored in it, NaN included
    n_nan: int
    nan_step: int | None  # first NaN
    min_value: float | None  # exact; None when every value is NaN; may be -inf
    min_step: int | None
    max_value: float | None  # exact; may be +inf
    max_step: int | None

    @property
    def nonfinite(self) -> bool:
        vals = (self.min_value, self.max_value)
        return self.n_nan > 0 or any(v is not None and math.isinf(v) for v in vals)


@dataclass(frozen=True)
class SeriesData:
    run_id: str
    metric: str
    branch: int  # the branch whose history (or, for branch="all", own steps) this is
    segments: list[tuple[int, int, int]]  # (branch, first step, last step) read
    bucket_width: int
    buckets: list[Bucket]


@dataclass(frozen=True)
class Matrix:
    """rows x buckets; cells with no value are None (n = 0)."""

    run_id: str
    metric: str
    branch: int
    rows: list[int]  # layer (layer_matrix) or head (head_matrix) numbers
    starts: list[int]  # first step of each bucket
    bucket_width: int
    min_value: list[list[float | None]]
    min_step: list[list[int | None]]
    max_value: list[list[float | None]]
    max_step: list[list[int | None]]
    n: list[list[int]]
    n_nan: list[list[int]]


@dataclass(frozen=True)
class EventRow:
    uid: str
    branch: int
    step: int | None
    kind: str
    source: str
    message: str
    data: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class CheckpointRow:
    branch: int
    step: int
    path: str
    pinned: bool
    checksum_status: str
    created_at: datetime


@dataclass(frozen=True)
class SampleRow:
    """A row a rollback named (models.Sample): where it was, what it is, what it measured."""

    step: int | None  # the rollback's detection step
    branch: int
    batch: int
    row: int
    sample_id: str | None
    loss: float | None
    grad_norm: float | None
    preview: str | None


@dataclass(frozen=True)
class BranchRow:
    number: int
    parent: int | None
    fork_step: int | None
    reason: str | None
    created_at: datetime


def session_factory(
    url: str | None = None, *, engine: Engine | None = None
) -> sessionmaker[Session]:
    """Sessions on `url` (resolved like everywhere else: --db, $SPIKEWATCH_DB_URL, default)."""
    return sessionmaker(engine or make_engine(url), expire_on_commit=False)


# -- runs -----------------------------------------------------------------------------------


def list_runs(
    session: Session, *, status: str | None = None, sweep_group: str | None = None, limit: int = 200
) -> list[RunSummary]:
    """Newest first, with last step / loss of the newest branch and spike / rollback counts."""
    q = select(Run).order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)
    if status is not None:
        q = q.where(Run.status == status)
    if sweep_group is not None:
        q = q.where(Run.sweep_group == sweep_group)
    return summarize(session, list(session.scalars(q)))


def get_run(session: Session, *, run_id: str) -> RunSummary:
    return summarize(session, [_run(session, run_id)])[0]


def summarize(session: Session, runs: list[Run]) -> list[RunSummary]:
    """Summaries of `runs` in three statements, however many runs there are."""
    if not runs:
        return []
    ids = [r.id for r in runs]
    counts = _event_counts(session, ids)
    q = select(Branch.run_id, func.count()).where(Branch.run_id.in_(ids)).group_by(Branch.run_id)
    n_branches = {rid: n for rid, n in session.execute(q)}
    last = _last_losses(session, ids)
    return [_summary(r, counts, n_branches.get(r.id, 0), last.get(r.id)) for r in runs]


def _utc(dt: datetime) -> datetime:
    """Timezone-aware UTC everywhere (SQLite hands stored UTC times back naive)."""
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt


def _run(session: Session, run_id: str) -> Run:
    run = session.scalars(select(Run).where(Run.key == run_id)).first()
    if run is None:
        raise NotFoundError(f"no run {run_id!r}")
    return run


def _event_counts(session: Session, run_ids: list[int]) -> dict[tuple[int, str], int]:
    q = (
        select(Event.run_id, Event.kind, func.count())
        .where(Event.run_id.in_(run_ids), Event.kind.in_(("spike", "rollback", "stall", "resumed")))
        .group_by(Event.run_id, Event.kind)
    )
    return {(rid, kind): n for rid, kind, n in session.execute(q)}


def _summary(
    run: Run,
    counts: dict[tuple[int, str], int],
    n_branches: int,
    last: tuple[int, float] | None,
) -> RunSummary:
    last_step, last_loss = last if last is not None else (None, None)
    summary = RunSummary(
        run_id=run.key,
        name=run.name,
        status=run.status,
        tags=list(run.tags or []),
        sweep_group=run.sweep_group,
        hypothesis=run.hypothesis,
        config=dict(run.config or {}),
        run_dir=run.run_dir,
        created_at=_utc(run.created_at),
        updated_at=_utc(run.updated_at),
        ended_at=_utc(run.ended_at) if run.ended_at else None,
        branches=n_branches,
        last_step=last_step,
        last_loss=last_loss,
        spikes=counts.get((run.id, "spike"), 0),
        rollbacks=counts.get((run.id, "rollback"), 0),
        stalled=run.status == "running"
        and counts.get((run.id, "stall"), 0) > counts.get((run.id, "resumed"), 0),
        heartbeat_at=_utc(run.heartbeat_at) if run.heartbeat_at else None,
        heartbeat_s=run.heartbeat_s,
    )
    return dataclasses.replace(summary, state=run_state(summary, datetime.now(UTC)))


def _last_losses(session: Session, run_pks: list[int]) -> dict[int, tuple[int, float]]:
    """Each run's newest branch's last loss point (branches without points yet are skipped),
    in one statement for all runs."""
    q = text(
        "SELECT s.run_id, s.branch, c.win, c.first_step, c.last_step, c.n, c.steps, c.vals "
        "FROM series s JOIN metric_names m ON m.id = s.metric_id "
        "JOIN point_windows c ON c.series_id = s.id WHERE s.run_id IN :runs AND m.name = :name "
        "AND c.win = (SELECT MAX(win) FROM point_windows WHERE series_id = s.id)"
    ).bindparams(bindparam("runs", expanding=True))
    newest: dict[int, tuple[int, int, float]] = {}
    rows = session.execute(q, {"runs": run_pks, "name": LOSS_METRIC})
    for run_pk, branch, win, first, last, n, steps, vals in rows:
        if run_pk not in newest or branch > newest[run_pk][0]:
            newest[run_pk] = (branch, last, float(decode(win, first, last, n, steps, vals)[1][-1]))
    return {rid: (step, value) for rid, (_, step, value) in newest.items()}


def branches(session: Session, *, run_id: str) -> list[BranchRow]:
    run = _run(session, run_id)
    q = select(Branch).where(Branch.run_id == run.id).order_by(Branch.number)
    return [
        BranchRow(b.number, b.parent, b.fork_step, b.reason, _utc(b.created_at))
        for b in session.scalars(q)
    ]


def metric_names(session: Session, *, run_id: str) -> list[str]:
    """Metric templates of a run (`train/loss`, `layer/*/grad_norm`, ...), sorted."""
    run = _run(session, run_id)
    q = (
        select(MetricName.name)
        .join(Series, Series.metric_id == MetricName.id)
        .where(Series.run_id == run.id)
        .distinct()
        .order_by(MetricName.name)
    )
    return list(session.scalars(q))


def events(
    session: Session,
    *,
    run_id: str,
    kinds: Sequence[str] | None = None,
    branch: int | None = None,
    start: int | None = None,
    end: int | None = None,
    limit: int = 10_000,
) -> list[EventRow]:
    """Events in step order (step-less ones last), optionally filtered."""
    run = _run(session, run_id)
    q = select(Event).where(Event.run_id == run.id)
    if kinds is not None:
        q = q.where(Event.kind.in_(list(kinds)))
    if branch is not None:
        q = q.where(Event.branch == branch)
    if start is not None:
        q = q.where(Event.step >= start)
    if end is not None:
        q = q.where(Event.step <= end)
    q = q.order_by(Event.step.is_(None), Event.step, Event.id).limit(limit)
    return [
        EventRow(
            e.uid,
            e.branch,
            e.step,
            e.kind,
            e.source,
            e.message,
            dict(e.data or {}),
            _utc(e.created_at),
        )
        for e in session.scalars(q)
    ]


def samples(session: Session, *, run_id: str) -> list[SampleRow]:
    """The samples the run's rollbacks named, in step, batch and row order."""
    run = _run(session, run_id)
    q = (
        select(Sample)
        .where(Sample.run_id == run.id)
        .order_by(Sample.step, Sample.batch, Sample.row, Sample.id)
    )
    return [
        SampleRow(r.step, r.branch, r.batch, r.row, r.sample_id, r.loss, r.grad_norm, r.preview)
        for r in session.scalars(q)
    ]


def checkpoints(session: Session, *, run_id: str) -> list[CheckpointRow]:
    run = _run(session, run_id)
    q = (
        select(Checkpoint)
        .where(Checkpoint.run_id == run.id)
        .order_by(Checkpoint.step, Checkpoint.id)
    )
    return [
        CheckpointRow(c.branch, c.step, c.path, c.pinned, c.checksum_status, _utc(c.created_at))
        for c in session.scalars(q)
    ]


# -- series and matrices --------------------------------------------------------------------


def series(
    session: Session,
    *,
    run_id: str,
    metric: str,
    branch: int | Literal["all"] | None = None,
    buckets: int = 2000,
    start: int | None = None,
    end: int | None = None,
) -> list[SeriesData]:
    """One metric downsampled to at most `buckets` buckets over [start, end].

    `branch`: None = the newest branch's history, an int = that branch's history, "all" = one
    SeriesData per branch with only that branch's own steps.
    """
    _check_buckets(buckets)
    run = _run(session, run_id)
    tree = branch_tree(session, run.id)
    ids = _series_ids(session, run.id, _key(metric), metric)
    if branch == "all":
        plans = [SeriesPlan(run_id, b, ids, [(b, 0, END)]) for b in sorted(ids)]
    else:
        b = _pick_branch(tree, branch, run_id)
        plans = [SeriesPlan(run_id, b, ids, lineage(tree, b))]
    return read_series(session, plans, metric, buckets, start, end)


@dataclass(frozen=True)
class SeriesPlan:
    """One line of a chart before it is read: a run's history of one metric, drawn for
    `branch`, as the `parts` (branch, first step, last step) of its lineage, each read from
    the series `ids[branch]` holds (a part whose branch has no series is left out)."""

    run_id: str
    branch: int
    ids: dict[int, int]
    parts: list[tuple[int, int, int]]


def read_series(
    session: Session,
    plans: Sequence[SeriesPlan],
    metric: str,
    buckets: int,
    start: int | None = None,
    end: int | None = None,
) -> list[SeriesData]:
    """The one read behind every line chart, of one run (`series`) or many (across_runs.py
    `histories`): every plan downsampled in one pass, on one grid of at most `buckets` buckets
    over [start, end], one SeriesData a plan."""
    segs = [
        (i, plan.ids[br], lo, hi)
        for i, plan in enumerate(plans)
        for br, lo, hi in plan.parts
        if br in plan.ids
    ]
    width, cells, read = downsample(session, segs, buckets, start, end)
    out = []
    for i, plan in enumerate(plans):
        branch_of = {sid: br for br, sid in plan.ids.items()}
        out.append(
            SeriesData(
                plan.run_id,
                metric,
                plan.branch,
                [(branch_of[sid], lo, hi) for g, sid, lo, hi in read if g == i],
                width,
                [_bucket(k, width, cells[(i, k)]) for k in sorted(k for g, k in cells if g == i)],
            )
        )
    return out


def layer_matrix(
    session: Session,
    *,
    run_id: str,
    metric: str,
    branch: int | None = None,
    buckets: int = 1000,
    start: int | None = None,
    end: int | None = None,
    extremes: Extremes = "both",
) -> Matrix:
    """layer x step for a per-layer metric template such as `layer/*/grad_norm` (or rank x step
    for a per-rank one, `rank/*/loss`).

    `extremes="max"` leaves the minima out (None): a heatmap of maxima costs half the reads.
    """
    prefix = M.RANK_PREFIX if metric.startswith(M.RANK_PREFIX) else M.LAYER_PREFIX
    key = _template(metric, prefix, per_head=False)
    keep = lambda s: s.layer >= 0 and s.head == NO_INDEX  # noqa: E731
    window = (buckets, start, end, extremes)
    return _matrix(session, run_id, key, branch, window, keep, "layer")


def head_matrix(
    session: Session,
    *,
    run_id: str,
    metric: str,
    layer: int,
    branch: int | None = None,
    buckets: int = 1000,
    start: int | None = None,
    end: int | None = None,
    extremes: Extremes = "both",
) -> Matrix:
    """head x step of one layer for a per-head template such as `layer/*/head/*/attn_max`."""
    key = _template(metric, M.HEAD_PREFIX, per_head=True)
    keep = lambda s: s.layer == layer and s.head >= 0  # noqa: E731
    window = (buckets, start, end, extremes)
    return _matrix(session, run_id, key, branch, window, keep, "head")


def _template(metric: str, prefix: str, *, per_head: bool) -> str:
    """A matrix's template; any other string names no matrix of any run (not found)."""
    if not metric.startswith(prefix) or ("/head/*/" in metric) != per_head:
        raise NotFoundError(f"no matrix {metric!r}: a template starts with {prefix!r}")
    return metric


def _key(metric: str) -> MetricKey:
    """A flat metric name's key; a name the store cannot hold is a metric no run has."""
    try:
        return parse_name(metric)
    except ValueError as e:
        raise NotFoundError(f"no metric {metric!r}: {e}") from None


def _matrix(
    session: Session,
    run_id: str,
    template: str,
    branch: int | None,
    window: tuple[int, int | None, int | None, Extremes],
    keep: Callable[[Any], bool],
    attr: str,
) -> Matrix:
    """Rows (layers or heads, picked by `keep`, labelled by `attr`) x buckets."""
    _check_buckets(window[0])
    run = _run(session, run_id)
    tree = branch_tree(session, run.id)
    b = _pick_branch(tree, branch, run_id)
    parts = lineage(tree, b)
    q = (
        select(Series.id, Series.branch, Series.layer, Series.head)
        .join(MetricName, MetricName.id == Series.metric_id)
        .where(Series.run_id == run.id, MetricName.name == template)
        .where(Series.branch.in_({br for br, _, _ in parts}))
    )
    found = [r for r in session.execute(q) if keep(r)]
    if not found:
        raise NotFoundError(f"run {run_id!r} has no values of {template!r} on branch {b}'s history")
    by = {(getattr(r, attr), r.branch): r.id for r in found}
    labels = sorted({getattr(r, attr) for r in found})
    buckets, start, end, extremes = window
    plan = MatrixPlan(run_id, b, by, parts, labels)
    (matrix,) = read_matrices(session, [plan], template, buckets, start, end, extremes)
    assert matrix is not None  # its rows are given: never left out
    return matrix


@dataclass(frozen=True)
class MatrixPlan:
    """One heatmap before it is read: a run's rows (layers, heads or ranks) of one template on
    `branch`'s history (its lineage's `parts`), the series of row r on branch br being
    `ids[r, br]`; `rows`: the rows shown (None: those with values in the window)."""

    run_id: str
    branch: int
    ids: dict[tuple[int, int], int]
    parts: list[tuple[int, int, int]]
    rows: list[int] | None = None


def read_matrices(
    session: Session,
    plans: Sequence[MatrixPlan],
    template: str,
    buckets: int,
    start: int | None = None,
    end: int | None = None,
    extremes: Extremes = "both",
) -> list[Matrix | None]:
    """The one read behind every heatmap, of one run (`layer_matrix`, `head_matrix`) or many
    (across_runs.py `layer_matrices`): every plan's rows downsampled in one pass, on one grid,
    one Matrix a plan (None for a plan of `rows=None` with no value in the window)."""
    segs = []
    for i, plan in enumerate(plans):
        rows = plan.rows if plan.rows is not None else sorted({r for r, _ in plan.ids})
        for r in rows:
            segs += [((i, r), plan.ids[r, br], lo, hi) for br, lo, hi in plan.parts
                     if (r, br) in plan.ids]  # fmt: skip
    width, found, read_labels, _ = downsample_buckets(session, segs, buckets, start, end)
    out: list[Matrix | None] = []
    for i, plan in enumerate(plans):
        index = [j for j, (g, _) in enumerate(read_labels) if g == i]
        mine = found.subset(np.isin(found.group, index))
        if plan.rows is None and not len(mine.n):
            out.append(None)
            continue
        rows = plan.rows if plan.rows is not None else sorted({read_labels[j][1] for j in index})
        row_of = np.zeros(len(read_labels), np.int64)
        row_of[index] = [rows.index(read_labels[j][1]) for j in index]
        ks, n, n_nan, mn, mn_s, mx, mx_s = mine.grids(row_of[mine.group], len(rows))
        if extremes != "both":
            mn = mn_s = [[None] * len(ks) for _ in rows]
        out.append(
            Matrix(
                plan.run_id,
                template,
                plan.branch,
                rows,
                [k * width for k in ks],
                width,
                mn,
                mn_s,
                mx,
                mx_s,
                n,
                n_nan,
            )  # fmt: skip
        )
    return out


def _check_buckets(buckets: int) -> None:
    if isinstance(buckets, bool) or not isinstance(buckets, int) or not 1 <= buckets <= MAX_BUCKETS:
        raise ValueError(f"buckets must be an int in [1, {MAX_BUCKETS}], got {buckets!r}")


def _pick_branch(tree: Tree, branch: int | None, run_id: str) -> int:
    if branch is None:
        return max(tree) if tree else 0
    if branch not in tree:
        raise NotFoundError(f"run {run_id!r} has no branch {branch}; it has {sorted(tree)}")
    return branch


def branch_series(session: Session, run_pk: int, key: MetricKey) -> dict[int, int]:
    """{branch: series id} of one metric of a run (the run's primary key); {} if it has none."""
    q = (
        select(Series.branch, Series.id)
        .join(MetricName, MetricName.id == Series.metric_id)
        .where(Series.run_id == run_pk, MetricName.name == key.template)
        .where(Series.layer == key.layer, Series.head == key.head)
    )
    return {b: sid for b, sid in session.execute(q)}


def _series_ids(session: Session, run_pk: int, key: MetricKey, metric: str) -> dict[int, int]:
    ids = branch_series(session, run_pk, key)
    if not ids:
        raise NotFoundError(f"no metric {metric!r} in this run")
    return ids


def _bucket(k: int, width: int, c: list[Any]) -> Bucket:
    return Bucket(k * width, k * width + width - 1, c[0], c[1], c[2], c[3], c[4], c[5], c[6])


def delete_run(session: Session, *, run_id: str) -> None:
    """Delete a run and everything stored for it (values have no FK to cascade)."""
    run = _run(session, run_id)
    ids = select(Series.id).where(Series.run_id == run.id).scalar_subquery()
    for table in (PointChunk, PointTail):
        session.execute(delete(table).where(table.series_id.in_(ids)))
    for model in (Series, Event, Checkpoint, Branch):
        session.execute(delete(model).where(model.run_id == run.id))
    session.execute(delete(Run).where(Run.id == run.id))
