"""A genuine spike, nothing injected: the paper's MLP under the Watch spikes near step 140 on
seed 1, the loss alone labels it, and the detector finds it (benchmarks/studies/genuine_spikes.py
runs the study; docs/spikes.md section 4)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from spikewatch.observatory import store

pytestmark = pytest.mark.e2e  # trains a model (tests/README.md)

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def study():
    return _load("genuine_study", ROOT / "benchmarks" / "studies" / "genuine_spikes.py")


def test_the_ground_truth_rule_on_a_known_curve(study) -> None:
    """Two decades above the floor is a spike, with its onset where the climb left 3x the
    floor; a 30x bump is not; a rise over a high floor that moves the loss by under 10% is not."""
    floor = [1e-10 * (1 + 0.5 * math.sin(i)) for i in range(400)]
    curve = list(floor)
    for k, i in enumerate(range(200, 215)):
        curve[i] = 1e-10 * 10 ** min(k, 7)  # climbs to 1e-3 from step 201 (1-based)
    curve[300] = 3e-9  # a 30x bump
    assert [(o, e) for o, _, e in study.label(curve)] == [(202, 215)]
    high_floor = [0.9 + x for x in curve]  # the same excess over a floor of 0.9
    assert study.label(high_floor, floor=0.9) == []  # 1e-3 over 0.9: no spike a user sees


def test_the_mlp_spikes_on_its_own_and_the_watch_finds_it(study, tmp_path) -> None:
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    r = study.run("mlp", 1, 200, "none", db=db, run_dir=tmp_path / "run")
    (spike, *_) = study.label(r["losses"])
    assert 130 <= spike[0] <= 150 and min(r["losses"][:130]) < 1e-8  # from its floor upwards
    with store.session_factory(db)() as s:
        found = study.verdicts(s, r["run_id"])
    assert study.match([spike], found)["detected"] == 1


def test_one_deep_trough_does_not_make_the_band_a_spike(study) -> None:
    """Near its floor the loss swings between 1e-9 and 1e-6; with the window's minimum as the
    floor, a swing's peak 100x above one deep trough was labelled a spike. The floor is the
    window's 10th percentile: the band is no spike, a climb out of it still is."""
    band = [1e-9 if i % 2 else 1e-7 for i in range(300)]
    band[150] = 1e-12  # one deep trough
    assert [o for o, _, _ in study.label(band, q=0.0)] == [152]  # the old rule: a "spike"
    assert study.label(band) == []
    climb = band[:200] + [1e-7 * 3**k for k in range(1, 9)] + band[208:]
    assert [(o, p) for o, p, _ in study.label(climb)] == [(201, 208)]


def test_the_replay_finds_the_mlp_spike_in_the_optimizer_state(study, tmp_path) -> None:
    """The first rollback's replay reproduces the spike on its own batches and on batches
    that trained well before the restore point: the cause is the optimizer state, recorded
    as such, and the policy keeps cutting the LR past `max_rollbacks` instead of halting."""
    db = f"sqlite:///{tmp_path / 'sw.db'}"
    r = study.run("mlp", 1, 400, "lrcut", db=db, run_dir=tmp_path / "run")
    with store.session_factory(db)() as s:
        rows = store.queries.events(s, run_id=r["run_id"], kinds=["rollback"])
    causes = [e.data["cause"] for e in rows]
    assert causes and set(causes) == {"state"}
    assert all(e.data["control_peak_loss"] > 10 * e.data["pre_spike_loss"] for e in rows)
    assert not r["halted"]
