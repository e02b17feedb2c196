"""The detector's incremental robust score equals the plain definition, bit for bit.

The reference below is the definition written out with `statistics.median` (what the detector
computed before it kept its windows sorted); every score must match it exactly, so no verdict of
any stored run, scan or benchmark moves."""

import math
import random
import statistics

import pytest

from spikewatch.observatory.detect import Detector, _Robust


def reference_score(values: list[float], v: float, floor: float, level_window: int) -> float:
    level = statistics.median(values[-level_window:])
    diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
    mad = 0.0
    if diffs:
        mid = statistics.median(diffs)
        mad = statistics.median([abs(d - mid) for d in diffs])
    return (v - level) / max(1.4826 * mad / math.sqrt(2), floor)


@pytest.mark.parametrize("window,level_window", [(64, 16), (7, 3), (8, 8), (5, 9), (2, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_score_is_the_plain_definition(window, level_window, seed):
    rng = random.Random(seed)
    robust = _Robust(window, level_window)
    kept: list[float] = []
    for i in range(600):
        # ties (rounded values), trends and jumps: the cases where sorted bookkeeping slips
        v = round(rng.gauss(0.001 * i, 0.05), 2 if seed % 2 else 12) + (3.0 if i % 97 == 0 else 0)
        if kept:
            floor = 0.001 * (1 + i % 3)
            assert robust.score(v, floor) == reference_score(kept, v, floor, level_window)
        robust.add(v)
        kept = (kept + [v])[-window:]
        if i == 300:  # a rebase, then a restored state
            robust.clear()
            kept = []
        if i == 450:
            robust = _Robust(window, level_window, robust.values)


def test_verdicts_survive_a_restored_state():
    rng = random.Random(0)
    losses = [2.0 + rng.gauss(0, 0.02) + (1.5 if 700 <= i < 720 else 0) for i in range(1200)]
    whole, restored = Detector(), Detector()
    a, b = [], []
    for step, loss in enumerate(losses):
        a += [v.to_dict() for v in whole.update(step, loss)]
        b += [v.to_dict() for v in restored.update(step, loss)]
        if step == 650:
            state = restored.state_dict()
            restored = Detector()
            restored.load_state_dict(state)
    assert a == b and any(v["kind"] == "spike" and v["onset_step"] == 700 for v in a)


def test_a_slow_climb_cannot_drag_the_level_up_with_it():
    """A loss that climbs 20,000-fold over 25 steps on a noisy floor (a genuine Adam spike:
    the log-loss jitters by about 1 a step there). Each step of the climb stays under the
    threshold, so before the points of a climb were held out of the level the level followed
    them up and no spike was ever reported; a climb that stops short still joins the level."""
    rng = random.Random(3)
    floor = [-18.0 + rng.gauss(0, 0.9) for _ in range(200)]
    climb = [-18.0 + 0.4 * i + rng.gauss(0, 0.2) for i in range(1, 26)]
    losses = [math.exp(z) for z in floor + climb + [-8.0] * 5]
    det = Detector()
    got = [v for step, loss in enumerate(losses) for v in det.update(step, loss)]
    spikes = [v for v in got if v.kind == "spike"]
    assert len(spikes) == 1 and 200 <= spikes[0].step < 225 and spikes[0].onset_step >= 195
    det = Detector()  # a climb of 4 steps to z ~ 5 that stops: it joins the level afterwards
    bumps = [-18.0 + rng.gauss(0, 0.9) for _ in range(120)] + [-14.5] * 4 + [-18.0] * 3
    for step, z in enumerate(bumps):
        det.update(step, math.exp(z))
    assert det.pending == [] and -14.5 in det.loss.values


def test_a_rollback_far_back_forgets_the_level_reached_since():
    """Rolled back from step 300 to step 10 (a warning moved the target back, or only an early
    checkpoint was left): the restored run's loss is the early, higher one. Judged against the
    converged level the run had reached since, it was a 'spike' at once, and with no checkpoint
    before it the run halted; the points after the target are another branch's and go."""
    rng = random.Random(5)
    early = [2.0 * math.exp(-s / 20) + 1.0 for s in range(40)]
    losses = early + [1.0 + rng.gauss(0, 0.002) for _ in range(260)]
    det = Detector()
    for step, loss in enumerate(losses, start=1):
        det.update(step, loss)
    det.rewind(10)
    assert len(det.loss.values) == 0  # its 64 points were all taken after step 10
    again = [v for step, loss in enumerate(early[10:], start=11) for v in det.update(step, loss)]
    assert [v for v in again if v.kind == "spike"] == []
    state = det.state_dict()  # the steps travel with the state
    restored = Detector()
    restored.load_state_dict(state)
    assert list(restored.loss.steps) == list(det.loss.steps)
