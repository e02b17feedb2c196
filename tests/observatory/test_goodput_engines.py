"""The engine's two executors, the numpy rounds over many lanes and the plain-Python loop over
one lane (goodput/scalar.py), are one model: every output of every lane is the same to the last
bit whichever runs it, from the start or from a hand-over in the middle of a run, with every
failure mode on."""

from __future__ import annotations

import numpy as np
import pytest

from spikewatch.observatory.goodput import Failures, Scenario, Spikes, Tier, rounds, simulate
from spikewatch.observatory.goodput import lanes as engine_mod
from spikewatch.observatory.goodput.model import Corruption, Maintenance

from .test_goodput import CAUSES, _small
from .test_goodput_modes import ALL_MODES

_MODES = dict(steps=20_000, **ALL_MODES)

PLANS = {
    "tiers": [
        _small(),
        _small(  # a capped exponential memory tier, keep-last-3 on disk
            tiers=(
                Tier("memory", 15, stall_s=1.0, restore_s=20.0, max_kept=6, replicas=2),
                Tier("disk", 100, stall_s=7.0, restore_s=120.0, retention="last", keep_last=3),
            )
        ),
        _small(tiers=(Tier("disk", 40, 5.0, 60.0, write_s=700.0, keep_last=1),)),  # waits
        _small(  # failures soon after a restore, where both tiers hold the same step: a tie
            failures=Failures(per_gpu_day=_small().failures.per_gpu_day * 10, causes=CAUSES),
            tiers=(
                Tier("memory", 30, 0.5, 20.0, retention="last", keep_last=2),
                Tier("disk", 60, 7.0, 120.0, write_s=100.0),
            ),
        ),
        _small(  # saves dearer than steps: failures in the middle of a stall
            gpus=512 * 24,
            step_s=0.05,
            tiers=(
                Tier("memory", 5, stall_s=2.0, restore_s=1.0, replicas=2),
                Tier("disk", 100, stall_s=30.0, restore_s=10.0),
            ),
        ),
        _small(  # spikes and failures faster than the run can progress: it gives up
            steps=3000,
            spikes=Spikes(per_1k_steps=40, back_steps=(30,)),
            failures=Failures(per_gpu_day=_small().failures.per_gpu_day * 30, causes=CAUSES),
        ),
    ],
    "modes": [
        _small(**_MODES),  # type: ignore[arg-type]
        _small(  # type: ignore[arg-type]
            **_MODES,
            tiers=(
                Tier("memory", 20, 0.5, 20.0, retention="last", keep_last=3),
                Tier("disk", 200, 7.0, 120.0, write_s=300.0, retention="last", keep_last=3),
            ),
        ),
        _small(  # type: ignore[arg-type]
            **_MODES,
            tiers=(Tier("memory", 7, 0.5, 20.0, max_kept=5), Tier("disk", 90, 7.0, 120.0)),
        ),
    ],
    "llama3": [
        Scenario(
            steps=100_000,
            failures=Failures(during_recovery=True),
            corruption=Corruption(per_gpu_day=20 / (16_384 * 54)),
            maintenance=Maintenance(every_s=54 * 86_400 / 47),
            spikes=Spikes(per_1k_steps=0.5, back_steps=(60, 100, 400), repeat=0.2),
        )
    ],
}


def _outputs(lanes: engine_mod.Lanes) -> dict[str, np.ndarray]:
    out = {
        "wall": lanes.wall_s,
        "finished": lanes.finished,
        "failures": lanes.failures,
        "spikes": lanes.spikes,
        "memory": lanes.restores_from_memory,
        "further": lanes.further_back,
        "further_steps": lanes.further_steps,
    }
    out |= {f"bucket {k}": v for k, v in lanes.buckets.items()}
    return out | {f"mode {k}": v for k, v in lanes.modes.items()}


def _run(plans: list[Scenario], one_by_one: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    with monkeypatch.context() as m:
        m.setattr(rounds, "ONE_BY_ONE", one_by_one)
        return _outputs(simulate(plans, seeds=5, seed=11, workers=1))


@pytest.mark.parametrize("family", list(PLANS))
def test_one_lane_at_a_time_equals_the_lane_rounds_to_the_bit(family, monkeypatch) -> None:
    plans = PLANS[family]
    rounds = _run(plans, 0, monkeypatch)  # numpy rounds to every lane's end
    alone = _run(plans, 10**9, monkeypatch)  # every lane in plain Python from the start
    handed = _run(plans, 3 * len(plans), monkeypatch)  # rounds, then the last lanes alone
    for k, want in rounds.items():
        np.testing.assert_array_equal(alone[k], want, err_msg=k)
        np.testing.assert_array_equal(handed[k], want, err_msg=k)
    # the runs met what they were built to meet
    assert rounds["failures"].sum() > 20 and rounds["spikes"].sum() > 20
    if family == "tiers":
        assert not rounds["finished"].all() and rounds["finished"].any()
    if family != "tiers":
        for k in ("recovery_failures", "stops", "corruptions", "corruption_rollbacks", "repeats"):
            assert rounds[f"mode {k}"].sum() > 0, k
