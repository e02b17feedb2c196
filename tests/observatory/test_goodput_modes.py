"""The goodput simulator's failure modes beyond failures and spikes (issue 40): each switch does
what docs/goodput.md says, and the wall time still splits exactly into buckets with every one
of them on."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from spikewatch.observatory.goodput import (
    BUCKETS,
    Cause,
    Failures,
    Scenario,
    Spikes,
    Tier,
    simulate,
)
from spikewatch.observatory.goodput.model import Corruption, Maintenance
from spikewatch.trainer.cli import main

from .test_goodput import CAUSES, _small


def _modes(**kw: object) -> Scenario:
    return _small(steps=20_000, **kw)


# every mode on at once (test_goodput_engines.py runs it through both executors too)
ALL_MODES = dict(
    failures=Failures(per_gpu_day=_small().failures.per_gpu_day, causes=CAUSES,
                      during_recovery=True),
    maintenance=Maintenance(every_s=20 * 3600.0, window_s=900.0),
    corruption=Corruption(per_gpu_day=2e-3, detect_steps=300),
    spikes=Spikes(per_1k_steps=1.5, back_steps=(30, 80), repeat=0.3),
    straggler=0.05,
)  # fmt: skip


def test_all_modes_on_the_wall_time_still_splits_exactly_into_buckets() -> None:
    sc = _modes(**ALL_MODES)
    lanes = simulate([sc], seeds=8)
    total = sum(lanes.buckets[k] for k in BUCKETS)
    np.testing.assert_allclose(total, lanes.wall_s, rtol=1e-12)
    for k in ("recovery_failures", "stops", "corruptions", "corruption_rollbacks", "repeats"):
        assert lanes.modes[k].sum() > 0, k
    assert lanes.finished.all()


def test_a_corruption_goes_back_past_every_poisoned_checkpoint() -> None:
    """Every rollback for a corruption throws away at least its detection delay; keep-last-3
    cannot reach that far with frequent snapshots and pays for it: exponential is ahead."""
    sdc = Corruption(per_gpu_day=4e-3, detect_steps=400)
    calm = Failures(per_gpu_day=0.0, causes=CAUSES)  # nothing else moves the run meanwhile
    plans = {
        r: _modes(
            corruption=sdc,
            failures=calm,
            spikes=Spikes(per_1k_steps=0.0),
            tiers=(
                Tier("memory", 20, 0.5, 20.0, retention=r, keep_last=3),
                Tier("disk", 200, 7.0, 120.0, retention=r, keep_last=3),
            ),
        )
        for r in ("last", "exponential")
    }
    lanes = simulate(list(plans.values()), seeds=20)
    for i, sc in enumerate(plans.values()):
        s = lanes.of(i)
        n = lanes.modes["corruption_rollbacks"][s]
        assert n.sum() > 20
        wasted = lanes.buckets["wasted_progress_from_corruption"][s]
        assert (wasted >= n * sdc.detect_steps * sc.step_s - 1e-6).all()
    last, exp = (lanes.goodput[lanes.of(i)].mean() for i in range(2))
    assert exp > last


def test_a_recovery_that_can_fail_takes_its_expected_time() -> None:
    """With failures during recovery at rate 1/M, a recovery of D takes (e^(D/M) - 1) M on
    average (a restart that fails starts over); without, exactly D."""
    one = Failures(per_gpu_day=_small().failures.per_gpu_day, causes=(Cause("any", 1.0),))
    plans = [
        _modes(restart_s=3600.0, failures=dataclasses.replace(one, during_recovery=on))
        for on in (False, True)
    ]
    lanes = simulate(plans, seeds=60)
    D = 3600.0 + plans[0].tier("disk").restore_s  # memory restores are rarer: disk-only below
    per = [
        lanes.buckets["infrastructure_recovery_from_disruption"][lanes.of(i)].sum()
        / lanes.failures[lanes.of(i)].sum()
        for i in range(2)
    ]
    assert per[0] == pytest.approx(3600.0)
    M = plans[1].mtbf_s
    restores = lanes.buckets["unproductive_checkpoint_restore_time"][lanes.of(1)].sum()
    restore = restores / lanes.failures[lanes.of(1)].sum()  # the mean restore of a failure
    want = (math.exp((3600.0 + restore) / M) - 1) * M - restore  # the restart's share
    assert per[1] == pytest.approx(want, rel=0.1) and D > 3600.0
    assert lanes.modes["recovery_failures"][lanes.of(1)].sum() > 50


def test_planned_stops_come_on_schedule_and_cost_their_window() -> None:
    every, window = 10 * 3600.0, 1200.0
    sc = _modes(maintenance=Maintenance(every_s=every, window_s=window))
    lanes = simulate([sc, _modes()], seeds=10)
    s = lanes.of(0)
    stops = lanes.modes["stops"][s]
    assert np.all(np.abs(stops - np.floor(lanes.wall_s[s] / every)) <= 1)
    planned = lanes.buckets["planned_maintenance"][s]
    assert (planned >= stops * (window + sc.restart_s)).all()
    assert lanes.goodput[s].mean() < lanes.goodput[lanes.of(1)].mean()
    assert not lanes.modes["stops"][lanes.of(1)].any()


def test_spikes_that_come_back_multiply_the_rollbacks() -> None:
    plans = [_modes(spikes=Spikes(per_1k_steps=1.5, back_steps=(50,), repeat=p)) for p in (0, 0.5)]
    lanes = simulate(plans, seeds=30)
    base, again = (lanes.spikes[lanes.of(i)].sum() for i in range(2))
    assert again / base == pytest.approx(2.0, rel=0.15)  # 1 / (1 - p)
    assert lanes.modes["repeats"][lanes.of(1)].sum() == pytest.approx(again * 0.5, rel=0.15)


def test_a_straggler_slows_every_step() -> None:
    """Every step trained (kept or thrown away by a rollback) takes 10% longer: that time is
    the straggler's bucket; failures, in wall time, then strike more steps."""
    calm = Failures(per_gpu_day=0.0, causes=CAUSES)
    plans = [_modes(straggler=x, failures=f) for f in (calm, _small().failures) for x in (0, 0.1)]
    lanes = simulate(plans, seeds=20)
    b = lanes.buckets
    s = lanes.of(1)  # no failures: every trained step is kept or a spike's
    trained = b["productive"][s] + b["wasted_progress_from_spike_rollback"][s]
    np.testing.assert_allclose(b["straggler_slowdown"][s], 0.1 * trained, rtol=1e-12)
    assert not b["straggler_slowdown"][lanes.of(0)].any()
    g = [lanes.goodput[lanes.of(i)].mean() for i in range(4)]
    assert g[1] < g[0] and g[3] < g[2]
    assert lanes.failures[lanes.of(3)].sum() > lanes.failures[lanes.of(2)].sum()


def test_simulate_sdc_retention_must_show(capsys) -> None:
    """`--sdc-rate ... --retention last-3` and `--retention exponential` differ, the
    exponential plan ahead (the issue's must-show)."""
    got = {}
    for r in ("last-3", "exponential"):
        args = ["simulate", "--sdc-rate", "llama3", "--retention", r, "--seeds", "20"]
        assert main([*args, "--no-search", "--json"]) == 0
        got[r] = json.loads(capsys.readouterr().out)["goodput"]
    assert got["exponential"] > got["last-3"]  # the same seeds: the same corruptions
