"""Reads across many runs at once, for the pages that show many (the compare page, sweep
reports): each function costs a fixed number of statements, however many runs it is given.

The line charts and heatmaps are read by the single-run reads' own functions (queries.py
`read_series`, `read_matrices`), given a plan a run: `histories` gives what `store.series`
gives for each run's newest branch, `layer_matrices` what `store.layer_matrix` gives, except
that all runs share one bucket grid (one chart, one x axis). What is here finds many runs'
series in one statement; the end values, peaks and per-layer values have no single-run twin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from sqlalchemy import bindparam, select, text
from sqlalchemy.orm import Session

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.store.chunks import WINDOW, decode
from spikewatch.observatory.store.downsample import END, Tree, lineage
from spikewatch.observatory.store.models import Branch, Event, MetricName, Run, Series
from spikewatch.observatory.store.names import NO_INDEX, parse_name
from spikewatch.observatory.store.queries import (
    Matrix,
    MatrixPlan,
    SeriesData,
    SeriesPlan,
    read_matrices,
    read_series,
)

__all__ = [
    "end_values",
    "histories",
    "layer_matrices",
    "layer_values",
    "peaks",
    "runs_by_key",
    "trees",
]


def runs_by_key(session: Session, keys: Iterable[str]) -> dict[str, Run]:
    """The runs (ORM rows) of these run ids; unknown ids are left out. One statement."""
    keys = list(dict.fromkeys(keys))
    if not keys:
        return {}
    return {r.key: r for r in session.scalars(select(Run).where(Run.key.in_(keys)))}


def trees(session: Session, run_pks: Sequence[int]) -> dict[int, Tree]:
    """Every run's branch tree, {run pk: {branch: (parent, fork step)}}. One statement."""
    out: dict[int, Tree] = {pk: {} for pk in run_pks}
    if run_pks:
        q = select(Branch.run_id, Branch.number, Branch.parent, Branch.fork_step).where(
            Branch.run_id.in_(list(run_pks))
        )
        for run, n, p, f in session.execute(q):
            out[run][n] = (p, f)
    return out


def _series(session: Session, run_pks: Sequence[int], template: str) -> list[Any]:
    """(run pk, series id, branch, layer, head) of a template in these runs. One statement."""
    q = (
        select(Series.run_id, Series.id, Series.branch, Series.layer, Series.head)
        .join(MetricName, MetricName.id == Series.metric_id)
        .where(Series.run_id.in_(list(run_pks)), MetricName.name == template)
    )
    return list(session.execute(q)) if run_pks else []


def _newest_parts(tree: Tree) -> list[tuple[int, int, int]]:
    return lineage(tree, max(tree)) if tree else []


def histories(
    session: Session, runs: dict[str, Run], metric: str, buckets: int
) -> dict[str, list[SeriesData]]:
    """Each run's newest-branch history of one scalar `metric` ([] for a run without it), on
    one shared grid of at most `buckets` buckets: `store.series`'s read (`read_series`), its
    series found for every run in one statement. Four statements."""
    key = parse_name(metric)
    pks = {r.id: k for k, r in runs.items()}
    tree_of = trees(session, list(pks))
    ids: dict[int, dict[int, int]] = {}
    for run, sid, br, layer, head in _series(session, list(pks), key.template):
        if (layer, head) == (key.layer, key.head):
            ids.setdefault(run, {})[br] = sid
    plans = [
        SeriesPlan(pks[pk], max(tree) if tree else 0, ids[pk], _newest_parts(tree))
        for pk, tree in tree_of.items()
        if pk in ids
    ]
    out: dict[str, list[SeriesData]] = {k: [] for k in runs}
    for line in read_series(session, plans, metric, buckets):
        if line.buckets:
            out[line.run_id] = [line]
    return out


def layer_matrices(
    session: Session, runs: dict[str, Run], template: str, buckets: int
) -> dict[str, Matrix]:
    """Each run's layer x step maxima of a per-layer template on its newest branch's history
    (runs without it are left out), on one shared grid: `store.layer_matrix`'s read
    (`read_matrices`), its series found for every run in one statement. Four statements."""
    pks = {r.id: k for k, r in runs.items()}
    tree_of = trees(session, list(pks))
    ids: dict[int, dict[tuple[int, int], int]] = {}
    for pk, sid, br, layer, head in _series(session, list(pks), template):
        if layer >= 0 and head == NO_INDEX:
            ids.setdefault(pk, {})[layer, br] = sid
    plans = [
        MatrixPlan(pks[pk], max(tree) if tree else 0, ids[pk], _newest_parts(tree))
        for pk, tree in tree_of.items()
        if pk in ids
    ]
    got = read_matrices(session, plans, template, buckets, extremes="max")
    return {m.run_id: m for m in got if m is not None}


def end_values(
    session: Session, run_pks: Sequence[int], tree_of: dict[int, Tree], metric: str, *, last: bool
) -> dict[int, float | None]:
    """Each run's last (or first) value of a scalar `metric` on its newest branch's history;
    NaN comes back as nan; None for a run without it. Two statements."""
    key = parse_name(metric)
    ids = {
        (run, br): sid
        for run, sid, br, layer, head in _series(session, run_pks, key.template)
        if (layer, head) == (key.layer, key.head)
    }
    parts = [
        (pk, i, ids[pk, br], lo, hi)
        for pk in run_pks
        for i, (br, lo, hi) in enumerate(_newest_parts(tree_of.get(pk, {})))
        if (pk, br) in ids
    ]
    if not parts:
        return {pk: None for pk in run_pks}
    pick = "MAX(win)" if last else "MIN(win)"
    edge = "first_step <= {hi}" if last else "last_step >= {lo}"
    sql = " UNION ALL ".join(
        f"SELECT {int(pk)}, {int(i)}, {int(lo)}, {int(hi)}, series_id, win, first_step, "
        f"last_step, n, steps, vals FROM point_windows WHERE series_id = {int(sid)} AND win = "
        f"(SELECT {pick} FROM point_windows WHERE series_id = {int(sid)} AND win BETWEEN "
        f"{int(lo) // WINDOW} AND {int(hi) // WINDOW} AND {edge.format(lo=int(lo), hi=int(hi))})"
        for pk, i, sid, lo, hi in parts
        for hi in [min(hi, END)]
    )
    found: dict[int, tuple[int, float]] = {}  # run -> (part index, value)
    for pk, i, lo, hi, _, win, first, last_step, n, steps, vals in session.execute(text(sql)):
        st, v = decode(win, first, last_step, n, steps, vals)
        inside = np.flatnonzero((st >= lo) & (st <= hi))
        if not len(inside):
            continue
        better = pk not in found or (i > found[pk][0] if last else i < found[pk][0])
        if better:
            found[pk] = (i, float(v[inside[-1] if last else inside[0]]))
    out: dict[int, float | None] = {pk: None for pk in run_pks}
    for pk, (_, value) in found.items():
        out[pk] = value
    return out


def peaks(session: Session, run_pks: Sequence[int], template: str) -> dict[int, float | None]:
    """Each run's largest value of every series of `template`, abandoned branches included,
    from the windows' stored maxima (exact). One statement."""
    q = text(
        "SELECT s.run_id, MAX(c.max_value) FROM point_windows c "
        "JOIN series s ON s.id = c.series_id JOIN metric_names m ON m.id = s.metric_id "
        "WHERE s.run_id IN :runs AND m.name = :name GROUP BY s.run_id"
    ).bindparams(bindparam("runs", expanding=True))
    out: dict[int, float | None] = {pk: None for pk in run_pks}
    if run_pks:
        for pk, v in session.execute(q, {"runs": list(run_pks), "name": template}):
            out[pk] = None if v is None else float(v)
    return out


def event_steps(session: Session, run_pks: Sequence[int], kind: str) -> dict[int, list[int]]:
    """Each run's steps of its events of `kind` (a spike's detection, say), abandoned branches
    included, in step order. One statement."""
    out: dict[int, list[int]] = {pk: [] for pk in run_pks}
    if run_pks:
        q = (
            select(Event.run_id, Event.step)
            .where(Event.run_id.in_(list(run_pks)), Event.kind == kind, Event.step.is_not(None))
            .order_by(Event.run_id, Event.step)
        )
        for pk, step in session.execute(q):
            if step is not None:
                out[pk].append(step)
    return out


def layer_values(
    session: Session, run_pks: Sequence[int], tree_of: dict[int, Tree], stat: str
) -> dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Every per-layer series of `stat` (`layer/<layer>/<stat>`, per-head ones excluded) of
    these runs, in full, on each run's newest branch's history: {run pk: {name: (steps,
    values)}}, steps increasing. Two statements."""
    q = (
        select(Series.run_id, Series.id, Series.branch, Series.layer, MetricName.name)
        .join(MetricName, MetricName.id == Series.metric_id)
        .where(Series.run_id.in_(list(run_pks)), MetricName.name.like(f"layer/%/{stat}"))
    )
    rows = [r for r in session.execute(q) if M.is_per_layer(r[4], stat)] if run_pks else []
    parts = {pk: _newest_parts(tree_of.get(pk, {})) for pk in run_pks}
    keep = {}  # series id -> (run pk, name, lo, hi) for the series on a run's newest history
    for pk, sid, br, layer, template in rows:
        for b, lo, hi in parts[pk]:
            if b == br:
                name = template.replace("*", str(layer), 1) if layer >= 0 else template
                keep[sid] = (pk, name, lo, hi)
    if not keep:
        return {pk: {} for pk in run_pks}
    sql = text(
        "SELECT series_id, win, first_step, last_step, n, steps, vals FROM point_windows "
        "WHERE series_id IN :ids"
    ).bindparams(bindparam("ids", expanding=True))
    pieces: dict[tuple[int, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for sid, win, first, last, n, steps, vals in session.execute(sql, {"ids": list(keep)}):
        pk, name, lo, hi = keep[sid]
        st, v = decode(win, first, last, n, steps, vals)
        inside = (st >= lo) & (st <= hi)
        pieces.setdefault((pk, name), []).append((st[inside], v[inside]))
    out: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {pk: {} for pk in run_pks}
    for (pk, name), got in pieces.items():
        st = np.concatenate([s for s, _ in got])
        v = np.concatenate([x for _, x in got])
        order = np.argsort(st, kind="stable")
        out[pk][name] = (st[order], v[order])
    return out
