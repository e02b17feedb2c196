"""The detector near zero loss, where Adam's own instability spikes (issue 30).

There the log-loss swings by a unit or more from one step to the next, so the noise scale is
wide; a genuine spike is a smooth climb of three decades that stays under the z threshold, and
its tail bounces back over the threshold for a few steps at a time. The golden curves are the
MLP's of `benchmarks/studies/genuine_spikes.py` (seeds 0 and 2) with the spikes its label rule,
which reads the loss alone, finds in them."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from spikewatch.observatory.detect import Detector, DetectorConfig, Verdict

GOLDEN = json.loads((Path(__file__).parent / "data" / "genuine_mlp.json").read_text())


def _spikes(det: Detector, log_losses: list[float], start: int = 1) -> list[Verdict]:
    out = []
    for step, z in enumerate(log_losses, start=start):
        out += [v for v in det.update(step, math.exp(z)) if v.kind == "spike"]
    return out


@pytest.mark.parametrize("seed", ["s0", "s2"])
def test_every_genuine_spike_once_and_nothing_else(seed: str) -> None:
    """Each labelled spike gets one verdict inside [onset, end + 3]; no verdict elsewhere."""
    labels = GOLDEN[seed]["labels"]
    found = [v.step for v in _spikes(Detector(), GOLDEN[seed]["log_loss"])]
    hits = [[d for d in found if onset <= d <= end + 3] for onset, _, end in labels]
    assert [len(h) for h in hits] == [1] * len(labels)
    assert sorted(d for h in hits for d in h) == found


def _band(rng: random.Random, n: int, level: float = -18.0) -> list[float]:
    """Log-loss near zero: a zig-zag of +-0.6 with noise (the MLP's floor)."""
    return [level + (0.6 if i % 2 else -0.6) + rng.gauss(0, 0.2) for i in range(n)]


def test_a_smooth_climb_in_wide_noise_is_a_spike() -> None:
    """A 1,300-fold climb over 12 rises in a row (x1.8 a step) stays near z ~ 3 here; the climb
    rule reports it while it climbs. Without the rule nothing is reported."""
    rng = random.Random(0)
    climb = [-18.0 + 0.6 * i for i in range(1, 13)]
    curve = _band(rng, 200) + climb + [-11.0 - 0.3 * i for i in range(20)] + _band(rng, 60)
    (v,) = _spikes(Detector(), curve)
    assert 199 <= v.onset_step <= v.step <= 212  # while it climbs
    assert _spikes(Detector(DetectorConfig(climb_factor=1e9)), curve) == []


_calm = random.Random(0)
CALM = [-10.0 + _calm.gauss(0, 0.1) for _ in range(200)]  # log-loss, noise 0.1
LEVEL, SCALE = -10.03, 0.098  # its level and noise scale, as the detector measures them


def at(z: float) -> float:
    """The log-loss `z` robust sigmas above CALM's level."""
    return LEVEL + z * SCALE


def test_the_calm_part_has_the_level_and_scale_the_tests_assume() -> None:
    det = Detector()
    _spikes(det, CALM)
    assert math.log(det.level()) == pytest.approx(LEVEL, abs=0.01)
    assert 1 / (det.loss.score(1.0, 0.01) - det.loss.score(0.0, 0.01)) == pytest.approx(SCALE, 0.01)


def _spike_with_tail() -> list[float]:
    """A jump to z = 20 for 20 steps, then a tail bouncing around z ~ 8: three steps at z = 6,
    three at z = 10, and so on for 24 steps, then back to the level."""
    tail = [at(10.0 if (i // 3) % 2 else 6.0) for i in range(24)]
    return CALM + [at(20.0)] * 20 + tail + [LEVEL] * 40


def test_a_bouncing_tail_is_the_same_spike() -> None:
    """The tail's bounces over the threshold are the spike still decaying, not new spikes
    (before the tail rule, each bounce after three calm steps was another verdict)."""
    (v,) = _spikes(Detector(), _spike_with_tail())
    assert v.onset_step == 201


def test_a_new_spike_out_of_the_tail_is_reported() -> None:
    """A jump of `threshold` sigmas over the tail's own level, or a fresh climb after the
    peak, is a new spike, though the first one's tail never came back to the level."""
    curve = _spike_with_tail()[:238] + [at(30.0)] * 10  # the tail's median is z ~ 8
    first, second = _spikes(Detector(), curve)
    assert (first.onset_step, second.onset_step, second.step) == (201, 239, 241)
    rng = random.Random(3)
    climb = [-18.0 + 0.6 * i for i in range(1, 13)]
    back = [-13.0 + (0.8 if i % 2 else -0.8) for i in range(8)]  # its tail, still high
    curve = _band(rng, 200) + climb + back + [-13.0 + 0.6 * i for i in range(1, 13)]
    first, second = _spikes(Detector(), curve)
    assert first.step <= 212 < 220 < second.onset_step <= second.step <= 232


def test_a_tail_that_settles_higher_ends_and_the_next_spike_counts() -> None:
    """A tail that stays above the level but under the threshold for `settle_steps` has
    settled: the spike is over, and a later spike gets its own verdict."""
    curve = CALM + [at(20.0)] * 10 + [at(6.0)] * 30 + [at(30.0)] * 10
    first, second = _spikes(Detector(), curve)
    assert first.onset_step == 201 and second.step == 243


@pytest.mark.parametrize(
    ("curve", "cut"),
    [("s2", 218), ("s2", 2324), ("tail", 236)],  # in a climb; in a tail coming back; in a tail
)
def test_a_state_saved_mid_spike_continues_identically(curve: str, cut: int) -> None:
    """The climb and the tail travel with the state: a detector restored there gives the
    verdicts the whole run gave."""
    log_loss = (
        GOLDEN[curve]["log_loss"] if curve in GOLDEN else _spike_with_tail()[:238] + [at(30.0)] * 10
    )
    whole = _spikes(Detector(), log_loss)
    det = Detector()
    before = _spikes(det, log_loss[:cut])
    restored = Detector()
    restored.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert before + _spikes(restored, log_loss[cut:], start=cut + 1) == whole
