"""Sweeps: a pre-registered grid of runs (variants x learning rates x seeds) and its report.

A sweep is registered before its first run (`register_sweep`): its name (the runs' `sweep_group`),
the grid as asked, and an optional hypothesis that can never be changed afterwards, so the
outcome is read against what was expected, not the other way round.

The report summarises any set of runs the same way (`report_for_runs`; `sweep_report` is that for
a group): per run its variant, learning rate and seed, final validation loss, the loss at
initialisation, the peak attention logit, spikes, rollbacks and the steps redone by rollbacks;
per variant the loss per learning rate and the **LR sensitivity** of Wortsman et al. (2023):

    mean over the LR grid of min(loss(lr), loss_0) - min over the grid of loss(lr)

where loss(lr) is the final validation loss averaged over seeds, loss_0 the loss at
initialisation (the variant's mean first training loss), and a run that diverged (non-finite
loss, or halted by the rollback policy) counts as loss_0. Lower is better: 0 means every learning
rate in the grid reached the best loss.

A run's cell comes from its tags (`variant=...`), else its name, and its config (`optim.lr`,
`train.seed`). When a cell was run more than once (a crashed attempt, then a retry), the newest
run stands for it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.reports.census import (
    GRAD_SPIKE_FACTOR,
    GRAD_SPIKE_WINDOW,
    Census,
    census_of,
)
from spikewatch.observatory.store import across_runs as across
from spikewatch.observatory.store.models import (
    Event,
    Sweep,
)
from spikewatch.observatory.store.queries import (
    LOSS_METRIC,
    NotFoundError,
    RunSummary,
    list_runs,
    summarize,
)

__all__ = [
    "Cell",
    "CensusRow",
    "Rate",
    "SweepConflictError",
    "SweepInfo",
    "SweepReport",
    "VariantSummary",
    "format_rate",
    "get_sweep",
    "list_sweeps",
    "lr_sensitivity",
    "register_sweep",
    "report_for_runs",
    "report_markdown",
    "sweep_report",
]

VAL_METRIC = M.VAL_LOSS
ATTN_MAX_TEMPLATE = M.LAYER_ATTN_MAX
VARIANT_TAG = "variant="
FINISHED = ("completed", "halted")  # a crashed ("failed") or stopped run is retried, not counted
DIVERGED = ("halted",)  # the rollback policy gave up: counts as diverged for LR sensitivity


class SweepConflictError(ValueError):
    """The sweep exists with another grid or hypothesis; the message says what differs."""


@dataclass(frozen=True)
class SweepInfo:
    name: str
    hypothesis: str | None
    spec: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class Cell:
    """One run of a grid, as stored (or a grid cell not run yet: run_id None, status pending)."""

    variant: str
    lr: float
    seed: int
    run_id: str | None = None
    status: str = "pending"
    last_step: int | None = None
    max_steps: int | None = None
    init_loss: float | None = None
    final_train: float | None = None
    final_val: float | None = None
    peak_attn: float | None = None
    spikes: int = 0
    first_spike: int | None = None
    rollbacks: int = 0
    recovery_steps: int = 0  # steps redone because of rollbacks (from_step - to_step, summed)
    census: Census = field(default_factory=Census)  # observatory/reports/census.py

    @property
    def diverged(self) -> bool:
        return self.status in DIVERGED or (
            self.final_val is not None and not math.isfinite(self.final_val)
        )


@dataclass(frozen=True)
class VariantSummary:
    variant: str
    val_by_lr: list[float | None]  # mean over seeds of the final validation loss, per `lrs`
    peak_by_lr: list[float | None]  # max over seeds of the peak attention logit, per `lrs`
    diverged_by_lr: list[bool]  # any seed diverged
    init_loss: float | None
    best_loss: float | None
    lr_sensitivity: float | None  # None until every learning rate has a finished run
    spikes: int
    rollbacks: int
    done: int
    total: int


@dataclass(frozen=True)
class Rate:
    """A rate per 1k steps over a cell's seeds: the mean, and the lowest and highest seed."""

    mean: float | None = None
    lo: float | None = None
    hi: float | None = None


@dataclass(frozen=True)
class CensusRow:
    """The spike census of one variant at one learning rate, over its runs (seeds)."""

    variant: str
    lr: float
    runs: int
    steps: int
    loss_spikes: Rate
    grad_spikes: Rate
    nonfinite: Rate
    rollbacks: Rate


@dataclass(frozen=True)
class SweepReport:
    group: str | None
    hypothesis: str | None
    created_at: datetime | None
    spec: dict[str, Any]
    lrs: list[float]
    variants: list[VariantSummary]
    cells: list[Cell] = field(default_factory=list)
    census: list[CensusRow] = field(default_factory=list)

    @property
    def is_lr_sweep(self) -> bool:
        return len(self.lrs) >= 2


# -- registration -------------------------------------------------------------------------------


def register_sweep(
    session: Session, *, name: str, spec: dict[str, Any], hypothesis: str | None = None
) -> SweepInfo:
    """Create the sweep, or return it when it exists with the same grid (a resumed sweep).

    The hypothesis is pre-registered: given again it must match; omitted, the stored one stays.
    """
    row = session.scalars(select(Sweep).where(Sweep.name == name)).first()
    if row is None:
        row = Sweep(name=name, spec=spec, hypothesis=hypothesis)
        session.add(row)
        session.commit()
        return _info(row)
    diff = sorted(
        k
        for k in set(spec) | set(row.spec)
        if k not in spec
        or k not in row.spec
        or not (_same_config if k == "config" else operator.eq)(row.spec[k], spec[k])
    )
    if diff:
        raise SweepConflictError(
            f"sweep {name!r} exists with another grid (differs in: {', '.join(diff)}); "
            "resume it with the same arguments or choose another --group"
        )
    if hypothesis is not None and hypothesis != row.hypothesis:
        raise SweepConflictError(
            f"sweep {name!r} was registered at {row.created_at:%Y-%m-%d %H:%M} with the "
            f"hypothesis {row.hypothesis!r}; a pre-registered hypothesis cannot be changed"
        )
    return _info(row)


def _same_config(old: Any, new: Any) -> bool:
    """Equal, except for keys only one side has: a setting added by a newer version of
    spikewatch (with its default) does not make a resumed sweep another grid."""
    if isinstance(old, dict) and isinstance(new, dict):
        return all(_same_config(old[k], new[k]) for k in old.keys() & new.keys())
    return bool(old == new)


def get_sweep(session: Session, name: str) -> SweepInfo | None:
    row = session.scalars(select(Sweep).where(Sweep.name == name)).first()
    return None if row is None else _info(row)


def list_sweeps(session: Session) -> list[SweepInfo]:
    rows = session.scalars(select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc()))
    return [_info(r) for r in rows]


def _info(row: Sweep) -> SweepInfo:
    created = row.created_at  # SQLite hands stored UTC times back naive
    created = created.replace(tzinfo=UTC) if created.tzinfo is None else created
    return SweepInfo(row.name, row.hypothesis, dict(row.spec or {}), created)


# -- the report ---------------------------------------------------------------------------------


def lr_sensitivity(losses: Sequence[float | None], init_loss: float | None) -> float | None:
    """Wortsman et al.'s LR sensitivity of one variant: losses per learning rate of the grid.

    None when a learning rate has no result yet or loss_0 is unknown; a non-finite loss counts
    as loss_0 (diverged), and no loss counts above loss_0.
    """
    if init_loss is None or not math.isfinite(init_loss) or not losses:
        return None
    known = [v for v in losses if v is not None]
    if len(known) < len(losses):
        return None
    capped = [min(v, init_loss) if math.isfinite(v) else init_loss for v in known]
    return sum(capped) / len(capped) - min(capped)


def sweep_report(session: Session, group: str) -> SweepReport:
    """The report of a sweep group: every cell of its registered grid, run or not."""
    info = get_sweep(session, group)
    runs = list_runs(session, sweep_group=group, limit=10_000)
    if info is None and not runs:
        raise NotFoundError(f"no sweep {group!r}")
    spec = info.spec if info else {}
    report = report_for_runs(session, runs, grid=spec or None)
    return SweepReport(
        group,
        info.hypothesis if info else None,
        info.created_at if info else None,
        spec,
        report.lrs,
        report.variants,
        report.cells,
        report.census,
    )


def report_for_runs(
    session: Session, runs: Sequence[RunSummary | str], *, grid: dict[str, Any] | None = None
) -> SweepReport:
    """Cells and per-variant summaries for `runs` (summaries or run ids), newest run per cell.

    `grid` (a sweep's spec: variants, lrs, seeds) adds the cells not run yet, as pending.
    """
    summaries = _summaries_of(session, runs)
    rows = across.runs_by_key(session, [r.run_id for r in summaries])
    pks = [rows[r.run_id].id for r in summaries]
    facts = _facts(session, pks, {rows[r.run_id].id: r.last_step for r in summaries})
    cells: dict[tuple[str, float, int], Cell] = {}
    for r in sorted(summaries, key=lambda s: s.created_at):
        cell = _cell(r, rows[r.run_id].id, facts)
        cells[(cell.variant, cell.lr, cell.seed)] = cell
    if grid:
        for v in grid.get("variants", []):
            for lr in grid.get("lrs", []):
                for seed in grid.get("seeds", [0]):
                    cells.setdefault((v, float(lr), int(seed)), Cell(v, float(lr), int(seed)))
    order = list(grid.get("variants", [])) if grid else []
    variants = order + sorted({v for v, _, _ in cells} - set(order))
    lrs = sorted({lr for _, lr, _ in cells})
    ordered = sorted(cells.values(), key=lambda c: (variants.index(c.variant), c.lr, c.seed))
    summary = [_variant(v, lrs, [c for c in ordered if c.variant == v]) for v in variants]
    census = [
        row
        for v in variants
        for lr in lrs
        if (row := _census_row(v, lr, [c for c in ordered if (c.variant, c.lr) == (v, lr)]))
    ]
    return SweepReport(None, None, None, dict(grid or {}), lrs, summary, ordered, census)


def _rate(values: list[float | None]) -> Rate:
    known = [v for v in values if v is not None]
    if not known:
        return Rate()
    return Rate(sum(known) / len(known), min(known), max(known))


def _census_row(variant: str, lr: float, cells: list[Cell]) -> CensusRow | None:
    """The census over a cell's seeds that have run (None when none has)."""
    ran = [c.census for c in cells if c.run_id is not None and c.census.steps]
    if not ran:
        return None
    return CensusRow(
        variant,
        lr,
        len(ran),
        sum(c.steps or 0 for c in ran),
        _rate([c.loss_spikes_per_1k for c in ran]),
        _rate([c.grad_spikes_per_1k for c in ran]),
        _rate([c.nonfinite_per_1k for c in ran]),
        _rate([c.rollbacks_per_1k for c in ran]),
    )


def _variant(name: str, lrs: list[float], cells: list[Cell]) -> VariantSummary:
    finished = [c for c in cells if c.status in FINISHED]
    vals: list[float | None] = []
    peaks: list[float | None] = []
    diverged: list[bool] = []
    inits = [c.init_loss for c in cells if c.init_loss is not None and math.isfinite(c.init_loss)]
    init = sum(inits) / len(inits) if inits else None
    for lr in lrs:
        at = [c for c in finished if c.lr == lr]
        div = [c for c in at if c.diverged]
        diverged.append(bool(div))
        if not at:
            vals.append(None)
        else:
            losses = [math.inf if c.diverged or c.final_val is None else c.final_val for c in at]
            vals.append(sum(losses) / len(losses))
        ps = [c.peak_attn for c in cells if c.lr == lr and c.peak_attn is not None]
        peaks.append(max(ps) if ps else None)
    present = [v for v, lr in zip(vals, lrs, strict=True) if any(c.lr == lr for c in cells)]
    finite = [v for v in present if v is not None and math.isfinite(v)]
    return VariantSummary(
        name,
        vals,
        peaks,
        diverged,
        init,
        min(finite) if finite else None,
        lr_sensitivity(present, init) if len(lrs) >= 2 else None,  # one LR: nothing to say
        sum(c.spikes for c in cells),
        sum(c.rollbacks for c in cells),
        len(finished),
        len(cells),
    )


def _summaries_of(session: Session, runs: Sequence[RunSummary | str]) -> list[RunSummary]:
    """Summaries for summaries or run ids, the ids read all at once (unknown: NotFoundError)."""
    keys = [r for r in runs if isinstance(r, str)]
    found = {}
    if keys:
        rows = across.runs_by_key(session, keys)
        if missing := [k for k in keys if k not in rows]:
            raise NotFoundError(f"no run {missing[0]!r}")
        found = {s.run_id: s for s in summarize(session, list(rows.values()))}
    return [found[r] if isinstance(r, str) else r for r in runs]


def _facts(
    session: Session, pks: list[int], last_step: dict[int, int | None]
) -> dict[str, dict[int, Any]]:
    """What the cells need beyond the run summaries, for all runs at once (a fixed number of
    statements): first spike, rollback records, first loss, last val loss, peak logit, census."""
    first_spike = dict(
        session.execute(
            select(Event.run_id, func.min(Event.step))
            .where(Event.run_id.in_(pks), Event.kind == "spike")
            .group_by(Event.run_id)
        ).all()
    )
    rollbacks: dict[int, list[Any]] = {pk: [] for pk in pks}
    q = select(Event.run_id, Event.data).where(Event.run_id.in_(pks), Event.kind == "rollback")
    for pk, data in session.execute(q):
        rollbacks[pk].append(data)
    tree_of = across.trees(session, pks)
    return {
        "first_spike": first_spike,
        "rollbacks": rollbacks,
        "init": across.end_values(session, pks, tree_of, LOSS_METRIC, last=False),
        "final_val": across.end_values(session, pks, tree_of, VAL_METRIC, last=True),
        "peak": across.peaks(session, pks, ATTN_MAX_TEMPLATE),
        "census": census_of(session, pks, tree_of, last_step),
    }


def _cell(r: RunSummary, pk: int, facts: dict[str, dict[int, Any]]) -> Cell:
    tagged = [t[len(VARIANT_TAG) :] for t in r.tags if t.startswith(VARIANT_TAG)]
    cfg = r.config
    redone = sum(
        max(0, int(d.get("from_step", 0)) - int(d.get("to_step", 0)))
        for d in facts["rollbacks"].get(pk, [])
        if isinstance(d, dict) and d.get("to_step") is not None
    )
    return Cell(
        variant=tagged[-1] if tagged else (r.name or r.run_id),
        lr=float(cfg.get("optim", {}).get("lr", math.nan)),
        seed=int(cfg.get("train", {}).get("seed", 0)),
        run_id=r.run_id,
        status=r.status,
        last_step=r.last_step,
        max_steps=cfg.get("train", {}).get("max_steps"),
        init_loss=facts["init"].get(pk),
        final_train=r.last_loss,
        final_val=facts["final_val"].get(pk),
        peak_attn=facts["peak"].get(pk),
        spikes=r.spikes,
        first_spike=facts["first_spike"].get(pk),
        rollbacks=r.rollbacks,
        recovery_steps=redone,
        census=facts["census"].get(pk, Census()),
    )


# -- Markdown -----------------------------------------------------------------------------------


def _num(v: float | None, fmt: str = ".3f") -> str:
    if v is None:
        return "–"
    if not math.isfinite(v):
        return "diverged" if v > 0 else str(v)
    return format(v, fmt)


def _lr(v: float) -> str:
    return f"{v:g}"


def report_markdown(report: SweepReport) -> str:
    """The report as Markdown tables (what `spikewatch sweep-report --markdown` prints)."""
    out = [f"# Sweep {report.group}" if report.group else "# Runs compared", ""]
    if report.hypothesis:
        at = report.created_at
        created = f" (registered {at:%Y-%m-%d %H:%M} UTC)" if at else ""
        out += [f"**Hypothesis**{created}: {report.hypothesis}", ""]
    head = "| variant | " + " | ".join(f"lr {_lr(lr)}" for lr in report.lrs)
    rule = "|---|" + "---:|" * len(report.lrs)
    out += ["## Final validation loss (mean over seeds)", "", head + " |", rule]
    for v in report.variants:
        cells = [
            "diverged" if div and (val is None or not math.isfinite(val)) else _num(val)
            for val, div in zip(v.val_by_lr, v.diverged_by_lr, strict=True)
        ]
        out.append(f"| {v.variant} | " + " | ".join(cells) + " |")
    out += ["", "## Peak attention logit (max over seeds)", "", head + " |", rule]
    for v in report.variants:
        out.append(f"| {v.variant} | " + " | ".join(_num(p, ".1f") for p in v.peak_by_lr) + " |")
    out += [
        "",
        "## Summary",
        "",
        "| variant | LR sensitivity | best loss | loss at init | spikes | rollbacks | runs done |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in report.variants:
        out.append(
            f"| {v.variant} | {_num(v.lr_sensitivity, '.4f')} | {_num(v.best_loss)} | "
            f"{_num(v.init_loss)} | {v.spikes} | {v.rollbacks} | {v.done}/{v.total} |"
        )
    out += _census_markdown(report)
    out.append("")
    return "\n".join(out)


def format_rate(r: Rate) -> str:
    """A census rate as the report and the compare page show it: mean (lowest–highest)."""
    if r.mean is None:
        return "–"
    if r.lo is None or r.hi is None or r.lo == r.hi:
        return f"{r.mean:.2f}"
    return f"{r.mean:.2f} ({r.lo:.2f}–{r.hi:.2f})"


def _census_markdown(report: SweepReport) -> list[str]:
    out = [
        "",
        "## Spike census (per 1k steps; mean over seeds, lowest–highest seed)",
        "",
        f"Gradient spike: a step where some layer's gradient norm exceeds {GRAD_SPIKE_FACTOR:g}x "
        f"the median of its previous {GRAD_SPIKE_WINDOW} values (observatory/reports/census.py).",
        "",
        "| variant | lr | runs | steps | loss spikes | gradient spikes | non-finite steps "
        "| rollbacks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report.census:
        out.append(
            f"| {row.variant} | {_lr(row.lr)} | {row.runs} | {row.steps} | "
            f"{format_rate(row.loss_spikes)} | {format_rate(row.grad_spikes)} | "
            f"{format_rate(row.nonfinite)} | {format_rate(row.rollbacks)} |"
        )
    if not report.census:
        out.append("| (no run has recorded a step yet) | | | | | | | |")
    return out
