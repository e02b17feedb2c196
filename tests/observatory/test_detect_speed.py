"""The detector's incremental robust score equals the plain definition, bit for bit.

The reference below is the definition written out with `statistics.median` (what the detector
computed before it kept its windows sorted); every score must match it exactly, so no verdict of
any stored run, scan or benchmark moves."""

import math
import random
import statistics

import pytest

from observatory.detect import Detector, _Robust


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
