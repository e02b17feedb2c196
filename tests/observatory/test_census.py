"""The spike census: gradient spikes against a brute-force reference, and each count of a stored
run (events, branches, several seeds) as the sweep report and its Markdown show it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from spikewatch.observatory import store
from spikewatch.observatory.reports import census
from spikewatch.observatory.reports.census import grad_spike_mask
from spikewatch.observatory.reports.sweeps import report_for_runs, report_markdown
from spikewatch.observatory.store.sink import DbSink


def _reference(values: list[float], factor: float, window: int, history: int) -> list[bool]:
    """The definition, written out: the median of the previous `window` finite values."""
    out, seen = [], []
    for v in values:
        if not math.isfinite(v):
            out.append(False)
            continue
        prev = seen[-window:]
        out.append(len(prev) >= history and v > factor * float(np.median(prev)))
        seen.append(v)
    return out


@pytest.mark.parametrize("n", [0, 5, 30, 257])
def test_grad_spikes_match_the_definition_written_out(n: int, monkeypatch) -> None:
    monkeypatch.setattr(census, "_CHUNK", 7)  # several chunks of the sliding median
    rng = np.random.default_rng(n)
    values = np.exp(rng.normal(0, 0.3, n))
    values[rng.random(n) < 0.05] *= 30  # spikes
    values[rng.random(n) < 0.05] = np.nan
    if n > 10:
        values[9] = np.inf
    for factor, window, history in [(10.0, 16, 4), (3.0, 40, 10), (1.5, 8, 8)]:
        got = grad_spike_mask(values, factor=factor, window=window, history=history)
        assert got.tolist() == _reference(values.tolist(), factor, window, history)
    if n == 257:
        assert 5 < grad_spike_mask(values, factor=10.0, window=16, history=4).sum() < 30


def _run(sink: DbSink, run: str, seed: int, *, trouble: bool) -> None:
    """100 steps of a run with grad norms of about 1 in three layers. With `trouble`: layer
    spikes at 40, 55 (and 70, abandoned by a rollback from 75 to 60), a loss spike at 72, two
    non-finite steps, then branch 1 from step 61 with a spike in another layer at 90."""
    sink.start_run(
        run,
        name="tiny",
        config={"optim": {"lr": 0.01}, "train": {"seed": seed, "max_steps": 100}},
        tags=["variant=baseline"],
    )
    layers = ["layer/0/attn/grad_norm", "layer/0/mlp/grad_norm", "layer/embed/grad_norm"]
    spikes = {0: {40: 0, 55: 2, 70: 0}, 1: {90: 1}} if trouble else {}
    last = 80 if trouble else 100
    for step in range(1, last + 1):
        metrics = {"train/loss": 3.0, "layer/0/head/1/attn_max": 500.0 * (step == 30)}
        for i, name in enumerate(layers):
            metrics[name] = 1.0 + 0.01 * ((step + i) % 5)
        if step in spikes.get(0, {}):
            metrics[layers[spikes[0][step]]] = 50.0
            if step == 70:
                metrics[layers[2]] = 40.0  # two layers at one step: one gradient spike
        sink.log_metrics(run, 0, step, metrics)
    if trouble:
        sink.log_event(run, "spike", step=72, message="spike")
        sink.log_event(run, "nonfinite", step=73, message="nan")
        sink.log_event(run, "nonfinite", step=74, message="nan")
        sink.start_branch(run, 1, parent=0, fork_step=60, reason="rollback")
        sink.log_event(run, "rollback", step=75, data={"from_step": 75, "to_step": 60})
        for step in range(61, 101):
            metrics = {"train/loss": 3.0}
            for i, name in enumerate(layers):
                metrics[name] = 1.0 + 0.01 * ((step + i) % 5)
            if step == 90:
                metrics[layers[1]] = 12.0
            sink.log_metrics(run, 1, step, metrics)
    sink.set_status(run, "completed")


def test_the_census_of_stored_runs(db_url: str, tmp_path: Path) -> None:
    with DbSink(db_url, spool_dir=tmp_path / "spool", linger_s=0.01) as sink:
        _run(sink, "rough", 0, trouble=True)
        _run(sink, "calm", 1, trouble=False)
        assert sink.flush(30)
    with store.session_factory(db_url)() as s:
        report = report_for_runs(s, ["rough", "calm"])
    rough, calm = (c.census for c in report.cells)
    # 40 and 55 on the kept history, 90 on the branch; 70 was rolled back; heads are not layers
    assert rough == census.Census(steps=100, loss_spikes=1, grad_spikes=3, nonfinite=2, rollbacks=1)
    assert calm == census.Census(steps=100)
    assert (rough.grad_spikes_per_1k, rough.nonfinite_per_1k) == (30.0, 20.0)
    assert report.variants[0].lr_sensitivity is None  # one learning rate: no sensitivity
    [row] = report.census
    assert (row.variant, row.lr, row.runs, row.steps) == ("baseline", 0.01, 2, 200)
    assert (row.grad_spikes.mean, row.grad_spikes.lo, row.grad_spikes.hi) == (15.0, 0.0, 30.0)
    assert row.loss_spikes.mean == 5.0 and row.rollbacks.hi == 10.0
    md = report_markdown(report)
    assert "| variant | lr | runs | steps | loss spikes | gradient spikes | non-finite steps" in md
    assert (
        "| baseline | 0.01 | 2 | 200 | 5.00 (0.00–10.00) | 15.00 (0.00–30.00) | "
        "10.00 (0.00–20.00) | 5.00 (0.00–10.00) |"
    ) in md
