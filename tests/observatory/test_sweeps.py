"""Sweeps: LR sensitivity on hand-made tables, pre-registration, and reports from stored runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from spikewatch.observatory import store
from spikewatch.observatory.reports.sweeps import (
    SweepConflictError,
    get_sweep,
    lr_sensitivity,
    register_sweep,
    report_for_runs,
    report_markdown,
    sweep_report,
)
from spikewatch.observatory.store.sink import DbSink

SPEC = {"variants": ["baseline", "qk_norm"], "lrs": [0.01, 0.1], "seeds": [0, 1]}


def test_lr_sensitivity_by_hand() -> None:
    # losses 3.0, 2.5, 4.0 with loss_0 = 5: mean 3.1667 - best 2.5
    assert lr_sensitivity([3.0, 2.5, 4.0], 5.0) == pytest.approx((3.0 + 2.5 + 4.0) / 3 - 2.5)
    # a loss above loss_0 is capped at loss_0; a diverged one (inf / nan) counts as loss_0
    assert lr_sensitivity([2.0, 6.0, math.inf], 5.0) == pytest.approx((2 + 5 + 5) / 3 - 2)
    assert lr_sensitivity([2.0, math.nan], 5.0) == pytest.approx((2 + 5) / 2 - 2)
    # every learning rate reached the same loss: 0, the best possible
    assert lr_sensitivity([2.0, 2.0], 5.0) == 0.0
    # incomplete grid or unknown loss_0: no number rather than a wrong one
    assert lr_sensitivity([2.0, None], 5.0) is None
    assert lr_sensitivity([2.0, 3.0], None) is None
    assert lr_sensitivity([], 5.0) is None


def test_a_hypothesis_is_registered_once_and_never_changed(db_url: str) -> None:
    sessions = store.session_factory(db_url)
    with sessions() as s:
        info = register_sweep(s, name="g", spec=SPEC, hypothesis="QK-norm lowers LR sensitivity")
        assert info.hypothesis == "QK-norm lowers LR sensitivity"
    with sessions() as s:  # resuming without --hypothesis keeps it; the same one is fine
        assert register_sweep(s, name="g", spec=SPEC).hypothesis == info.hypothesis
        assert register_sweep(s, name="g", spec=SPEC, hypothesis=info.hypothesis)
        with pytest.raises(SweepConflictError, match="cannot be changed"):
            register_sweep(s, name="g", spec=SPEC, hypothesis="z-loss wins")
        with pytest.raises(SweepConflictError, match="differs in: seeds"):
            register_sweep(s, name="g", spec={k: v for k, v in SPEC.items() if k != "seeds"})
        with pytest.raises(SweepConflictError, match="differs in: lrs"):
            register_sweep(s, name="g", spec={**SPEC, "lrs": [0.01]})
        assert get_sweep(s, "g").created_at == info.created_at
        cfg = {"optim": {"lr": 0.01, "eps": 1e-8}}
        register_sweep(s, name="c", spec={**SPEC, "config": cfg})
        # a newer spikewatch adds a setting (with its default): the same grid, resumable
        newer = {"optim": {"lr": 0.01, "eps": 1e-8}, "watch": {"policy": {"new_knob": None}}}
        assert register_sweep(s, name="c", spec={**SPEC, "config": newer}).name == "c"
        with pytest.raises(SweepConflictError, match="differs in: config"):
            register_sweep(s, name="c", spec={**SPEC, "config": {"optim": {"lr": 0.1}}})
        assert get_sweep(s, "nope") is None


def _record(sink: DbSink, run: str, variant: str, lr: float, seed: int, **kw) -> None:
    """A finished run: loss 5.5 at step 1, val losses, attention maxima, optional spikes."""
    sink.start_run(
        run,
        name="tiny",
        config={"optim": {"lr": lr}, "train": {"seed": seed, "max_steps": 10}},
        tags=[f"variant={variant}", f"lr={lr:g}", f"seed={seed}"],
        sweep_group="g",
    )
    for step in range(1, 11):
        metrics = {"train/loss": 5.5 if step == 1 else kw["val"] + 0.1}
        metrics["layer/0/attn_max"] = kw["peak"] * step / 10
        metrics["layer/1/attn_max"] = 1.0
        if step in (5, 10):
            metrics["val/loss"] = kw["val"] if step == 10 else 9.0
        sink.log_metrics(run, 0, step, metrics)
    if kw.get("rollback"):
        sink.log_event(run, "spike", step=6, message="spike")
        sink.start_branch(run, 1, parent=0, fork_step=3, reason="rollback")
        sink.log_event(run, "rollback", step=6, data={"from_step": 6, "to_step": 3})
        for step in range(4, 11):  # the continued branch ends lower than the abandoned one
            sink.log_metrics(run, 1, step, {"val/loss": kw["val"] - 0.5} if step == 10 else {})
    sink.set_status(run, kw.get("status", "completed"))


def test_report_numbers_equal_what_was_stored(db_url: str, tmp_path: Path) -> None:
    sessions = store.session_factory(db_url)
    with sessions() as s:
        register_sweep(s, name="g", spec=SPEC, hypothesis="h")
    with DbSink(db_url, spool_dir=tmp_path / "spool", linger_s=0.01) as sink:
        _record(sink, "b1", "baseline", 0.01, 0, val=3.0, peak=10.0)
        _record(sink, "b2", "baseline", 0.01, 1, val=3.2, peak=12.0)
        _record(sink, "b3", "baseline", 0.1, 0, val=3.0, peak=900.0, status="halted")
        _record(sink, "q1", "qk_norm", 0.01, 0, val=2.8, peak=5.0, rollback=True)
        _record(sink, "q2", "qk_norm", 0.1, 0, val=2.9, peak=6.0)
        assert sink.flush(30)
    with sessions() as s:
        report = sweep_report(s, "g")
    assert report.hypothesis == "h" and report.lrs == [0.01, 0.1]
    cells = {(c.variant, c.lr, c.seed): c for c in report.cells}
    assert len(cells) == 8  # 2 x 2 x 2 from the spec; 3 not run
    assert cells[("qk_norm", 0.1, 1)].status == "pending"
    b1 = cells[("baseline", 0.01, 0)]
    assert (b1.final_val, b1.peak_attn, b1.init_loss) == (3.0, 10.0, 5.5)
    q1 = cells[("qk_norm", 0.01, 0)]
    assert q1.final_val == pytest.approx(2.3)  # the continued branch's, not the abandoned one's
    assert (q1.rollbacks, q1.spikes, q1.first_spike, q1.recovery_steps) == (1, 1, 6, 3)
    base, qk = report.variants
    assert base.val_by_lr[0] == pytest.approx(3.1)  # mean over seeds
    assert base.diverged_by_lr == [False, True] and math.isinf(base.val_by_lr[1])
    assert base.peak_by_lr == [12.0, 900.0]
    assert base.lr_sensitivity == pytest.approx((3.1 + 5.5) / 2 - 3.1)
    assert qk.lr_sensitivity == pytest.approx((2.3 + 2.9) / 2 - 2.3)
    assert (qk.done, qk.total) == (2, 4)
    md = report_markdown(report)
    assert "**Hypothesis**" in md and "| baseline | 3.100 | diverged |" in md
    assert f"| qk_norm | {qk.lr_sensitivity:.4f} |" in md
    with sessions() as s:  # any runs compare the same way; no grid, no pending cells
        plain = report_for_runs(s, ["b1", "q2"])
    assert [c.run_id for c in plain.cells] == ["b1", "q2"]


def test_a_retried_cell_is_stood_for_by_its_newest_run(db_url: str, tmp_path: Path) -> None:
    with DbSink(db_url, spool_dir=tmp_path / "spool", linger_s=0.01) as sink:
        _record(sink, "first", "baseline", 0.01, 0, val=3.0, peak=1.0, status="failed")
        assert sink.flush(30)
        _record(sink, "retry", "baseline", 0.01, 0, val=2.5, peak=1.0)
        assert sink.flush(30)
    with store.session_factory(db_url)() as s:
        report = sweep_report(s, "g")
    assert [c.run_id for c in report.cells] == ["retry"]
    with store.session_factory(db_url)() as s, pytest.raises(store.NotFoundError):
        sweep_report(s, "no-such-group")
