"""The spike census: how often each kind of trouble happened in a run, per 1k steps.

The four counts, per run:

- **loss spikes**: the online detector's `spike` verdicts (observatory/detect.py), as stored
  events, wherever they happened: a spike that was rolled back still happened.
- **gradient spikes**: steps at which at least one layer's gradient norm (every per-layer
  `layer/<layer>/grad_norm` series the probes recorded, heads excluded) exceeded
  `GRAD_SPIKE_FACTOR` (10) times the median of that layer's previous `GRAD_SPIKE_WINDOW` (100)
  finite values, once the layer has `GRAD_SPIKE_HISTORY` (20) of them. Counted on the run's
  kept history (its newest branch and that branch's ancestors up to each fork). Huang et al.
  (2025, SPAM) report gradient spikes of 50-1000x the typical value per parameter; a whole
  layer's norm is an average over millions of parameters, so 10x its median is already an
  event no healthy step produces (docs/spikes.md shows the false-positive count on clean runs).
- **non-finite steps**: `nonfinite` verdicts, one per step whose loss or gradient norm was NaN
  or infinite (the loop refused those updates).
- **rollbacks**: `rollback` events.

Rates are per 1k steps of the run (its last step), so runs of different lengths compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from spikewatch.observatory import metric_names as M
from spikewatch.observatory.store import across_runs as across
from spikewatch.observatory.store.downsample import Tree
from spikewatch.observatory.store.models import Event

__all__ = [
    "GRAD_SPIKE_FACTOR",
    "GRAD_SPIKE_HISTORY",
    "GRAD_SPIKE_WINDOW",
    "Census",
    "census_of",
    "grad_spike_mask",
]

GRAD_SPIKE_FACTOR = 10.0
GRAD_SPIKE_WINDOW = 100
GRAD_SPIKE_HISTORY = 20
_CHUNK = 1 << 15  # rows of the sliding median computed at once (bounded memory)


@dataclass(frozen=True)
class Census:
    """One run's counts and the steps they are counted over (None: no steps recorded)."""

    steps: int | None = None
    loss_spikes: int = 0
    grad_spikes: int = 0
    nonfinite: int = 0
    rollbacks: int = 0

    def per_1k(self, count: int) -> float | None:
        return None if not self.steps else 1000.0 * count / self.steps

    @property
    def loss_spikes_per_1k(self) -> float | None:
        return self.per_1k(self.loss_spikes)

    @property
    def grad_spikes_per_1k(self) -> float | None:
        return self.per_1k(self.grad_spikes)

    @property
    def nonfinite_per_1k(self) -> float | None:
        return self.per_1k(self.nonfinite)

    @property
    def rollbacks_per_1k(self) -> float | None:
        return self.per_1k(self.rollbacks)


def grad_spike_mask(
    values: np.ndarray,
    *,
    factor: float = GRAD_SPIKE_FACTOR,
    window: int = GRAD_SPIKE_WINDOW,
    history: int = GRAD_SPIKE_HISTORY,
) -> np.ndarray:
    """Which values exceed `factor` times the median of the previous `window` finite values
    (with at least `history` of them); non-finite values are never spikes and never history."""
    values = np.asarray(values, np.float64)
    out = np.zeros(len(values), bool)
    finite = np.flatnonzero(np.isfinite(values))
    v = values[finite]
    if len(v) <= history:
        return out
    # the median before value i is over v[max(0, i - window):i]; the first `window` values
    # have a shorter history, handled one by one
    head = min(window, len(v))
    for i in range(history, head):
        out[finite[i]] = v[i] > factor * np.median(v[:i])
    if len(v) > window:
        windows = sliding_window_view(v[:-1], window)  # row j: v[j:j + window], before v[j+window]
        for lo in range(0, len(windows), _CHUNK):
            med = np.median(windows[lo : lo + _CHUNK], axis=1)
            idx = np.arange(lo, lo + len(med)) + window
            out[finite[idx]] = v[idx] > factor * med
    return out


def census_of(
    session: Session,
    run_pks: Sequence[int],
    tree_of: dict[int, Tree],
    last_step: dict[int, int | None],
) -> dict[int, Census]:
    """Every run's census, read for all runs at once: three statements."""
    counts: dict[tuple[int, str], int] = {}
    if run_pks:
        q = (
            select(Event.run_id, Event.kind, func.count())
            .where(Event.run_id.in_(list(run_pks)))
            .where(Event.kind.in_(("spike", "nonfinite", "rollback")))
            .group_by(Event.run_id, Event.kind)
        )
        counts = {(pk, kind): n for pk, kind, n in session.execute(q)}
    grads = across.layer_values(session, run_pks, tree_of, M.STAT_GRAD_NORM)
    out = {}
    for pk in run_pks:
        spiked: set[int] = set()
        for steps, values in grads.get(pk, {}).values():
            spiked.update(steps[grad_spike_mask(values)].tolist())
        out[pk] = Census(
            steps=last_step.get(pk),
            loss_spikes=counts.get((pk, "spike"), 0),
            grad_spikes=len(spiked),
            nonfinite=counts.get((pk, "nonfinite"), 0),
            rollbacks=counts.get((pk, "rollback"), 0),
        )
    return out
